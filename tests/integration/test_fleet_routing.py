"""A real fleet routes by residency: 3 CPU workers of one base model and 1 of another, 24
adapters, Zipf (s = 1.1) open-loop traffic through a gateway with routing and one without, in
the same run. S3 GETs are counted in the S3 server's own request log; every job's tokens are
compared with its adapter's PEFT reference; a worker is SIGKILLed mid-run. A second base
model's jobs wait in its own pool queue until its worker starts, and hot adapters published
or retired while the workers run are pinned or unpinned on them.

Its own stack (Redis, S3, two gateways, four workers): the session's single worker would
take jobs from the shared queues and blur the counts.
"""

from __future__ import annotations

import json
import os
import random
import re
import shutil
import signal
import time
from collections import Counter
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest
from redis import Redis

from contracts.digests import manifest_of
from contracts.errors import ErrorCode
from contracts.jobs import JobPublic, JobStatus
from contracts.keys import JOB_EVENTS, worker_key
from contracts.queues import Tier, queue_for
from contracts.storage import blob_key
from lorafleet.fixtures import AdapterSpec, write_adapter
from lorafleet.processes import Child
from lorafleet.publish import Publisher
from lorafleet.registry import RegistryError
from lorafleet.settings import LocalSettings
from lorafleet.stack import LocalStack
from lorafleet.validation import ADAPTER_FILES
from tests.helpers import terminal_events
from tests.oracle import PeftOracle

ADAPTERS_PER_PHASE = 12
JOBS = 150
RATE_PER_S = 8.0
ZIPF_S = 1.1
MAX_COPIES = 2
SAMPLING = {"max_tokens": 6, "temperature": 0.0, "ignore_eos": True}
PROMPTS = ("Classify the sentiment of this review", "Translate the greeting")
DEADLINE_S = 120
WORKER_ENV = {
    "LORAFLEET_JOB_DEADLINE_S": str(DEADLINE_S),
    "LORAFLEET_WORKER_CONCURRENCY": "32",
    "LORAFLEET_MAX_LORAS": "2",
    "LORAFLEET_MAX_CPU_LORAS": "4",
    "LORAFLEET_DISK_CACHE_BYTES": str(64 * 1024 * 1024),
    # A dead worker is seen within ~6 s, its deliveries restored within a second after.
    "LORAFLEET_HEARTBEAT_S": "1",
    "LORAFLEET_RESTORE_INTERVAL_S": "1",
    "LORAFLEET_LEASE_TTL_S": "8",
    "LORAFLEET_VISIBILITY_TIMEOUT_S": str(DEADLINE_S + 15),
    # A routed job waiting longer goes back to the shared queue, where any worker may take it
    # and make one more copy: long enough that a loaded machine does not do it here.
    "LORAFLEET_ROUTE_MAX_WAIT_S": "15",
    "LORAFLEET_ENGINE_PROBE_TIMEOUT_S": "30",
}
GATEWAY_ENV = {
    "LORAFLEET_JOB_DEADLINE_S": str(DEADLINE_S),
    "LORAFLEET_ROUTE_MAX_COPIES": str(MAX_COPIES),
    "LORAFLEET_TENANT_MAX_CONCURRENT": "1000",
    "LORAFLEET_TENANT_RATE_PER_S": "1000",
    "LORAFLEET_TENANT_BURST": "1000",
}


class RoutedFleet:
    def __init__(self, stack: LocalStack, root: Path) -> None:
        self.stack = stack
        self.root = root
        self.redis: Redis = stack.redis()
        self.workers: dict[str, Child] = {}
        self.urls: dict[str, str] = {}
        self.specs: dict[str, Path] = {}

    def spawn(self, name: str, env: dict[str, str] | None = None) -> Child:
        return self.stack.spawn_worker(
            {
                **WORKER_ENV,
                **(env or {}),
                "LORAFLEET_WORKER_NAME": f"{name}@%h",
                # One disk cache per worker: each fetch is its own.
                "LORAFLEET_CACHE_DIR": str(self.root / f"cache-{name}"),
            },
            name=name,
        )

    def client(self, routing: bool) -> httpx.Client:
        auth = {"Authorization": f"Bearer {self.stack.api_key}"}
        return httpx.Client(base_url=self.urls["on" if routing else "off"], headers=auth)

    def weights_gets(self, alias: str) -> int:
        """GETs of ``alias``'s weights file in the S3 server's own request log."""
        weights = manifest_of(self.specs[alias], ADAPTER_FILES).files[1]
        log = (self.stack.log_dir / "s3.log").read_text()
        return len(re.findall(rf'"GET /[^ ]*{re.escape(blob_key(weights.sha256))}[^ ]* HTTP', log))


def _adapters(base: Path, directory: Path, prefix: str, count: int, seed: int) -> list[Path]:
    paths = []
    for index in range(count):
        spec = AdapterSpec(f"{prefix}-{index:02d}", seed + index, 8, 16, ("q_proj", "v_proj"))
        write_adapter(directory / spec.name, spec, base)
        paths.append(directory / spec.name)
    return paths


def _second_base(base: Path, out: Path) -> Path:
    """Another base model: the fixture's, one weight changed (another content digest)."""
    from safetensors.torch import load_file, save_file

    shutil.copytree(base, out)
    tensors = load_file(str(out / "model.safetensors"))
    name = sorted(tensors)[0]
    tensors[name] = tensors[name] * 1.01
    save_file(tensors, str(out / "model.safetensors"), metadata={"format": "pt"})
    return out


@pytest.fixture(scope="module")
def fleet(tmp_path_factory: pytest.TempPathFactory, fixtures_dir: Path) -> Iterator[RoutedFleet]:
    root = tmp_path_factory.mktemp("routed")
    settings = LocalSettings(
        state_dir=root / "state", s3_bucket="lorafleet-routed", redis_url=None, s3_endpoint_url=None
    )
    base = (fixtures_dir / "base").resolve()
    stack = LocalStack(settings, base)
    try:
        stack.start_infra()
        fleet = RoutedFleet(stack, root)
        publisher = stack.publisher()
        for path in _adapters(base, root / "adapters", "zipf", 2 * ADAPTERS_PER_PHASE, 81_000):
            publisher.publish(path, path.name, Tier.COLD)
            fleet.specs[path.name] = path
        stack.start_gateway({**GATEWAY_ENV, "LORAFLEET_ROUTING": "false"})
        fleet.urls["off"] = stack.gateway_url
        stack.start_gateway(GATEWAY_ENV)
        fleet.urls["on"] = stack.gateway_url
        started = [fleet.spawn(f"routed-{i}") for i in range(3)]
        for worker in started:
            fleet.workers[stack.wait_worker(worker)] = worker
        yield fleet
    finally:
        stack.stop()


def _zipf(aliases: list[str], count: int, seed: int) -> list[str]:
    weights = [1 / rank**ZIPF_S for rank in range(1, len(aliases) + 1)]
    return random.Random(seed).choices(aliases, weights, k=count)


def _open_loop(
    api: httpx.Client, aliases: list[str], seed: int, at: dict[int, Any] | None = None
) -> list[str]:
    """Submit one job per alias at Poisson times (``RATE_PER_S``); ``at[i]()`` runs just
    before the i-th submission. The accepted job ids, in order."""
    pace = random.Random(seed + 1)
    ids = []
    for index, alias in enumerate(aliases):
        if at and index in at:
            at[index]()
        prompt = PROMPTS[index % len(PROMPTS)]
        body = {"adapter": alias, "prompt": prompt, "sampling": SAMPLING}
        response = api.post("/v1/jobs", json=body, timeout=30)
        assert response.status_code == 202, response.text
        ids.append(response.json()["id"])
        time.sleep(pace.expovariate(RATE_PER_S))
    return ids


def _locate(redis: Redis, job_id: str) -> str:
    """Where a job's message is: which lists, or kombu's unacknowledged deliveries."""
    places = []
    for key in redis.scan_iter("lorafleet.*"):
        if redis.type(key) == "list" and any(job_id in m for m in redis.lrange(key, 0, -1)):  # type: ignore[union-attr]
            places.append(str(key))
    for tag, raw in redis.hgetall("unacked").items():  # type: ignore[union-attr]
        if job_id in raw:
            places.append(f"unacked[{tag}]")
    for key in redis.scan_iter("lorafleet:held:*"):
        if job_id in redis.hvals(key):  # type: ignore[operator]
            places.append(str(key))
    return ", ".join(places) or "nowhere"


def _finished(api: httpx.Client, ids: list[str], redis: Redis | None = None) -> list[JobPublic]:
    """Every job once terminal. With ``redis``: a job still queued a minute after the last
    submission fails the test with where its message is (a lost job would otherwise show
    only as ``deadline_exceeded`` two minutes later)."""
    jobs = []
    started = time.monotonic()
    for job_id in ids:
        while True:
            body = api.get(f"/v1/jobs/{job_id}", params={"wait_s": 10}, timeout=60).json()
            job = JobPublic.model_validate(body)
            if job.status.terminal:
                break
            waited = time.monotonic() - started
            if redis is not None and job.status == JobStatus.QUEUED and waited > 60:
                pytest.fail(
                    f"job {job_id} still queued after {waited:.0f} s: {_locate(redis, job_id)}"
                )
            assert waited < DEADLINE_S + 30, f"job {job_id} never ended"
        jobs.append(job)
    return jobs


def _check_tokens(jobs: list[JobPublic], oracle: PeftOracle, fleet: RoutedFleet) -> None:
    prompts = {}
    for job in jobs:
        assert job.status == JobStatus.SUCCEEDED, (job.id, job.status, job.error)
        assert job.result is not None and job.metadata is not None
        assert job.metadata.identity_verified
        prompts.setdefault(job.adapter, set()).add(tuple(job.result.token_ids))
    for alias, seen in prompts.items():
        expected = {
            oracle.tokens(fleet.specs[alias], prompt, SAMPLING["max_tokens"]) for prompt in PROMPTS
        }
        assert seen <= expected, f"{alias}: {seen} not among its PEFT references {expected}"


def test_routing_bounds_each_adapters_fetches_where_a_shared_queue_fetches_it_everywhere(
    fleet: RoutedFleet, fixtures_dir: Path
) -> None:
    oracle = PeftOracle(fixtures_dir)
    aliases = sorted(fleet.specs)
    unrouted, routed = aliases[:ADAPTERS_PER_PHASE], aliases[ADAPTERS_PER_PHASE:]
    with fleet.client(routing=False) as api:
        off = _finished(api, _open_loop(api, _zipf(unrouted, JOBS, 1), 1))
    with fleet.client(routing=True) as api:
        on = _finished(api, _open_loop(api, _zipf(routed, JOBS, 2), 2))
    _check_tokens(off + on, oracle, fleet)
    gets_off = {alias: fleet.weights_gets(alias) for alias in unrouted}
    gets_on = {alias: fleet.weights_gets(alias) for alias in routed}
    decisions = Counter(job.metadata.routed for job in on if job.metadata)
    print(f"GETs without routing {gets_off}; with routing {gets_on}; decisions {decisions}")
    assert all(job.metadata and job.metadata.routed == "shared" for job in off)
    # No holder was ever overloaded here, so routing never fell back to the shared queue
    # (which may make one copy more: README, "Routing").
    assert decisions["shared"] == 0, decisions
    elsewhere = [
        (job.adapter, job.metadata.routed_to, job.worker)
        for job in on
        if job.metadata and job.metadata.routed_to != job.worker
    ]
    assert max(gets_on.values()) <= MAX_COPIES, (gets_on, elsewhere)
    # The same traffic without routing: popular adapters fetched by every worker.
    assert max(gets_off.values()) > MAX_COPIES, gets_off
    assert sum(gets_on.values()) < sum(gets_off.values())
    for job in on:
        assert job.metadata is not None and job.metadata.routed_to == job.worker


def test_a_worker_killed_mid_run_loses_nothing_and_runs_nothing_twice(
    fleet: RoutedFleet, fixtures_dir: Path
) -> None:
    oracle = PeftOracle(fixtures_dir)
    routed = sorted(fleet.specs)[ADAPTERS_PER_PHASE:]
    pubsub = fleet.redis.pubsub()
    pubsub.subscribe(JOB_EVENTS)
    killed: list[str] = []
    killed_at: list[float] = []

    def kill_busiest() -> None:
        # The worker holding the most adapters: the one most jobs are routed to.
        def held(worker_id: str) -> int:
            raw = fleet.redis.get(worker_key(worker_id))
            return len(json.loads(str(raw))["adapters"]) if raw else -1

        victim = max(fleet.workers, key=held)
        os.killpg(fleet.workers[victim].pid, signal.SIGKILL)
        killed.append(victim)
        killed_at.append(time.time())

    with fleet.client(routing=True) as api:
        ids = _open_loop(api, _zipf(routed, 90, 3), 3, at={30: kill_busiest})
        jobs = _finished(api, ids, fleet.redis)
    (victim,) = killed
    fleet.workers.pop(victim).process.wait(timeout=10)
    _check_tokens(jobs, oracle, fleet)
    events = terminal_events(pubsub, quiet_s=2.0)
    pubsub.close()
    assert all(events[job_id] == 1 for job_id in ids), {i: events[i] for i in ids}
    # Nothing finished on the dead worker after its death.
    for job in jobs:
        if job.worker == victim:
            assert job.finished_at is not None and job.finished_at.timestamp() < killed_at[0]
    # Jobs routed to it that it had not finished ran elsewhere, handed back.
    handed_back = [j for j in jobs if j.metadata and j.metadata.routed_to == victim]
    assert any(job.worker != victim for job in handed_back), (
        "no job routed to the killed worker ran elsewhere: the kill tested nothing"
    )


def test_a_second_base_models_jobs_wait_in_its_pool_and_run_only_on_its_own_worker(
    fleet: RoutedFleet, fixtures_dir: Path
) -> None:
    other = _second_base((fixtures_dir / "base").resolve(), fleet.root / "other-base")
    publisher = Publisher(
        base_dir=other,
        base_model_id=str(other),
        limits=fleet.stack.settings.limits,
        registry=fleet.stack.publisher().registry,
        s3=fleet.stack.s3(),
        bucket=fleet.stack.settings.s3_bucket,
    )
    aliases = []
    for path in _adapters(other, fleet.root / "other-adapters", "other", 2, 91_000):
        publisher.publish(path, path.name, Tier.COLD)
        aliases.append(path.name)
    pool_queue = queue_for(Tier.COLD, publisher.base_model.digest)
    # Admitted before any worker of its base model lives (through the gateway that does not
    # route, straight to the pool queue): the workers of the other base model never take them.
    with fleet.client(routing=False) as api:
        early = _open_loop(api, [aliases[i % 2] for i in range(6)], 6)
    time.sleep(3)  # the three workers of the fixture model poll their own queues meanwhile
    assert fleet.redis.llen(pool_queue) == len(early)
    own = fleet.spawn("other-0", {"LORAFLEET_MODEL": str(other)})
    own_id = fleet.stack.wait_worker(own)
    time.sleep(2)  # the gateways' next read of the fleet (every 0.5 s) sees it
    with fleet.client(routing=True) as api:
        ids = _open_loop(api, [aliases[i % 2] for i in range(20)], 4)
        mixed = _open_loop(api, _zipf(sorted(fleet.specs)[ADAPTERS_PER_PHASE:], 20, 5), 5)
        jobs, others = _finished(api, early + ids), _finished(api, mixed)
    for job in jobs:
        assert job.status == JobStatus.SUCCEEDED, (job.id, job.error)
        assert job.worker == own_id and job.metadata is not None
        assert job.queue == pool_queue
        assert job.metadata.base_model.digest == publisher.base_model.digest
        assert job.metadata.identity_verified
    assert all(job.status == JobStatus.SUCCEEDED and job.worker != own_id for job in others)


def test_a_hot_adapter_published_or_retired_is_pinned_or_unpinned_on_the_live_workers(
    fleet: RoutedFleet, fixtures_dir: Path
) -> None:
    """No restart: each live worker of the pool that takes the hot tier pins a hot adapter
    published now (its jobs find it in a GPU slot and equal their PEFT reference), and
    unpins it when it is retired, which frees the slot for the next one."""
    oracle = PeftOracle(fixtures_dir)
    base = (fixtures_dir / "base").resolve()
    publisher = fleet.stack.publisher()
    first, second = _adapters(base, fleet.root / "hot-adapters", "hot", 2, 95_000)
    fleet.specs.update({first.name: first, second.name: second})
    pool = [
        w
        for w in fleet.workers
        if _announced(fleet, w)["base_model"]["digest"] == (publisher.base_model.digest)
    ]
    assert len(pool) >= 2
    record = publisher.publish(first, first.name, Tier.HOT)

    def pinned_everywhere(digest: str) -> bool:
        return all(_announced(fleet, w)["adapters"].get(digest) == "pinned" for w in pool)

    _wait(lambda: pinned_everywhere(record.digest), "every worker of the pool to pin it")
    with fleet.client(routing=True) as api:
        jobs = _finished(api, _open_loop(api, [first.name] * 8, 7))
    _check_tokens(jobs, oracle, fleet)
    assert {job.metadata.residency_before for job in jobs if job.metadata} == {"gpu"}
    # One pin slot per worker here (LORAFLEET_MAX_LORAS=2): a second hot adapter is refused.
    with pytest.raises(RegistryError) as refused:
        publisher.publish(second, second.name, Tier.HOT)
    assert refused.value.code == ErrorCode.PINS_EXCEED_SLOTS
    publisher.registry.retire(first.name)
    _wait(
        lambda: all(_announced(fleet, w)["adapters"].get(record.digest) != "pinned" for w in pool),
        "every worker to unpin the retired adapter",
    )
    assert all(_announced(fleet, w)["pinned"] == [] for w in pool)
    replacement = publisher.publish(second, second.name, Tier.HOT)
    _wait(lambda: pinned_everywhere(replacement.digest), "the freed slots to pin the next one")
    with fleet.client(routing=True) as api:
        jobs = _finished(api, _open_loop(api, [second.name] * 4, 8))
    _check_tokens(jobs, oracle, fleet)
    assert {job.metadata.residency_before for job in jobs if job.metadata} == {"gpu"}
    publisher.registry.retire(second.name)


def _announced(fleet: RoutedFleet, worker_id: str) -> dict[str, Any]:
    raw = fleet.redis.get(worker_key(worker_id))
    assert raw is not None, f"{worker_id} announces nothing"
    record: dict[str, Any] = json.loads(str(raw))
    return record


def _wait(condition: Any, what: str, timeout_s: float = 120) -> None:
    deadline = time.monotonic() + timeout_s
    while not condition():
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        time.sleep(0.5)
