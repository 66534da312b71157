"""Both metrics endpoints, scraped before and after a mixed workload, count what it did."""

from __future__ import annotations

import time
from collections import Counter

import httpx
from celery import Celery
from prometheus_client.parser import text_string_to_metric_families
from redis import Redis

from contracts import metrics as names
from contracts.queues import Tier, pool_id
from contracts.registry import AdapterRecord
from gateway.config import GatewaySettings
from lorafleet.client import auth_headers
from lorafleet.stack import LocalStack
from lorafleet.tenants import Tenants
from tests.conftest import STACK_ENV
from tests.gateway.conftest import serving
from tests.helpers import run_jobs, worker_heartbeat

Sample = tuple[str, tuple[tuple[str, str], ...]]


def _operator_key(redis: Redis) -> str:
    _, key = Tenants(redis).create(f"scraper-{time.monotonic_ns()}", operator=True)
    return key


def _scrape(url: str, key: str | None = None) -> dict[Sample, float]:
    response = httpx.get(url, timeout=30, headers=auth_headers(key) if key else None)
    assert response.status_code == 200
    return {
        (sample.name, tuple(sorted(sample.labels.items()))): sample.value
        for family in text_string_to_metric_families(response.text)
        for sample in family.samples
    }


Scrape = dict[Sample, float]


def _delta(before: Scrape, after: Scrape, name: str, **labels: str) -> float:
    key = (name, tuple(sorted(labels.items())))
    return after.get(key, 0.0) - before.get(key, 0.0)


def test_metrics_count_a_mixed_workload(
    api: httpx.Client, gateway_url: str, redis: Redis, published: dict[str, AdapterRecord]
) -> None:
    worker_url = f"http://127.0.0.1:{worker_heartbeat(redis)['metrics_port']}/metrics"
    key = _operator_key(redis)
    gateway_before, worker_before = _scrape(f"{gateway_url}/metrics", key), _scrape(worker_url)

    by_tier = {tier: [r.alias for r in published.values() if r.tier == tier] for tier in Tier}
    work = [(alias, "Extract the total") for tier in Tier for alias in by_tier[tier][:3]]
    jobs = run_jobs(api, work, {"max_tokens": 4, "temperature": 0.0})
    refused = api.post("/v1/jobs", json={"adapter": "no-such-adapter", "prompt": "hi"})
    assert refused.status_code == 404
    gateway_after, worker_after = _scrape(f"{gateway_url}/metrics", key), _scrape(worker_url)

    tiers = Counter(published[alias].tier.value for alias, _ in work)
    for tier, count in tiers.items():
        assert _delta(gateway_before, gateway_after, names.JOBS_ADMITTED, tier=tier) == count
        finished = _delta(
            worker_before, worker_after, names.JOBS_FINISHED, tier=tier, status="succeeded", code=""
        )
        assert finished == count
        e2e = _delta(worker_before, worker_after, names.JOB_E2E + "_count", tier=tier)
        assert e2e == count
        # Every job that reached the engine asked for a slot (a pinned adapter's too: ~0 s).
        slot_waits = _delta(worker_before, worker_after, names.JOB_SLOT_WAIT + "_count", tier=tier)
        assert slot_waits == count
        base = next(r.base_model for r in published.values() if r.tier == tier)
        pool_labels = {"base_model": base.id, "pool": pool_id(base.digest), "tier": tier}
        assert (names.QUEUE_DEPTH, tuple(sorted(pool_labels.items()))) in gateway_after
    assert (
        _delta(gateway_before, gateway_after, names.ADMISSIONS_REFUSED, code="adapter_not_found")
        == 1
    )

    levels = Counter(job.metadata.residency_before for job in jobs if job.metadata)
    for level in ("gpu", "cpu", "disk", "remote"):
        assert (
            _delta(worker_before, worker_after, names.ADAPTER_LOOKUPS, level=level)
            == (levels[level])
        ), level
    assert _delta(worker_before, worker_after, names.IDENTITY_CHECKS, result="verified") == len(
        jobs
    )
    assert _delta(worker_before, worker_after, names.IDENTITY_CHECKS, result="mismatched") == 0

    requested = sum(
        after - gateway_before.get(key, 0.0)
        for key, after in gateway_after.items()
        if key[0] == names.ADAPTER_REQUESTS
    )
    assert requested == len(jobs)
    # The engine's own gauges are served alongside.
    assert any(name == "vllm:num_requests_running" for name, _ in worker_after)
    assert any(name == "vllm:kv_cache_usage_perc" for name, _ in worker_after)


def test_gateway_metrics_take_an_operator_key_unless_public(
    api: httpx.Client, gateway_url: str, redis: Redis, stack: LocalStack
) -> None:
    anonymous = httpx.get(f"{gateway_url}/metrics", timeout=30)
    assert anonymous.status_code == 401
    assert anonymous.json()["error"]["code"] == "unauthorized"
    tenant = api.get("/metrics")  # the dev tenant: a key, but not an operator's
    assert tenant.status_code == 403
    assert tenant.json()["error"]["code"] == "forbidden"
    operator = httpx.get(
        f"{gateway_url}/metrics", headers=auth_headers(_operator_key(redis)), timeout=30
    )
    assert operator.status_code == 200
    assert names.JOBS_ADMITTED in operator.text
    with serving(GatewaySettings(redis_url=stack.redis_url, metrics_public=True)) as public:
        scraped = httpx.get(f"{public}/metrics", timeout=30)
    assert scraped.status_code == 200
    assert names.JOBS_ADMITTED in scraped.text


def test_a_ready_worker_started_its_threads_cached_vllms_env_and_both_froze_their_heaps(
    gateway_url: str, redis: Redis, stack: LocalStack
) -> None:
    # Asked as Flower asks: the job worker's pool (not the webhook worker's, not warmed).
    app = Celery(broker=stack.redis_url)
    try:
        stats = app.control.inspect(timeout=5).stats() or {}
    finally:
        app.close()
    pools = [info["pool"] for node, info in stats.items() if node.startswith("worker@")]
    assert pools, f"no job worker answered: {sorted(stats)}"
    concurrency = int(STACK_ENV["LORAFLEET_WORKER_CONCURRENCY"])
    for pool in pools:
        assert pool["threads"] == pool["max-concurrency"] == concurrency
    # All of them at start-up, not by the jobs of earlier tests: the worker says so.
    logged = (stack.log_dir / "worker.log").read_text()
    assert f"{concurrency} job threads started" in logged
    # vLLM's frontend reads its environment per output unless cached (the engine core caches).
    assert "vLLM's environment variables read once and cached" in logged

    worker = _scrape(f"http://127.0.0.1:{worker_heartbeat(redis)['metrics_port']}/metrics")
    gateway = _scrape(f"{gateway_url}/metrics", _operator_key(redis))
    # The worker's heap holds vLLM, torch and transformers: hundreds of thousands of objects.
    assert worker[(names.HEAP_FROZEN, ())] > 100_000
    assert gateway[(names.HEAP_FROZEN, ())] > 10_000
