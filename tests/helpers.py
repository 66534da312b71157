"""Helpers shared by test modules."""

from __future__ import annotations

import asyncio
import json
import os
import socket
import time
import uuid
from collections import Counter
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

import httpx
from celery import Celery
from redis import Redis

from contracts.job_records import RECORD_FIELDS, job_of
from contracts.jobs import JobPublic, JobStatus
from contracts.keys import WORKERS_INDEX, job_key, queue_ledger_key, worker_key
from contracts.queues import QUEUE_PREFIX, Tier, queue_for
from contracts.registry import AdapterRecord
from lorafleet.client import JobsClient
from lorafleet.fixtures import AdapterSpec, write_adapter
from lorafleet.publish import Publisher
from lorafleet.registry import Registry
from lorafleet.stack import LocalStack


def until(check: Callable[[], object], timeout_s: float = 10) -> None:
    """Wait for ``check()`` to hold, polling; fail the test if it does not within ``timeout_s``
    (a bound for a stalled machine, not a timing assertion)."""
    deadline = time.monotonic() + timeout_s
    while not check():
        assert time.monotonic() < deadline, "condition not met in time"
        time.sleep(0.01)


def processes_with_env(marker: str) -> list[int]:
    """Pids whose environment contains ``marker`` (the test's unique state dir)."""
    found = []
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit() or int(entry.name) == os.getpid():
            continue
        try:
            if marker.encode() in (entry / "environ").read_bytes():
                found.append(int(entry.name))
        except OSError:
            continue
    return found


def async_client(api: httpx.Client, timeout: float = 30) -> httpx.AsyncClient:
    """An async client of ``api``'s gateway carrying its ``Authorization`` header (for
    ``JobsClient``)."""
    return httpx.AsyncClient(
        base_url=api.base_url,
        headers={"Authorization": api.headers["Authorization"]},
        timeout=timeout,
    )


def run_jobs(
    api: httpx.Client, work: list[tuple[str, str]], sampling: dict[str, Any]
) -> list[JobPublic]:
    """Submit every (adapter, prompt) first, then wait for all: they run concurrently."""

    async def go() -> list[JobPublic]:
        async with async_client(api) as http:
            client = JobsClient(http)
            accepted = [await client.submit(name, prompt, sampling) for name, prompt in work]
            return list(await asyncio.gather(*(client.wait(job.id, 300) for job in accepted)))

    return asyncio.run(go())


@contextmanager
def paused(stack: LocalStack, queue: str) -> Iterator[None]:
    """The stack's worker stops consuming ``queue`` (jobs stay in Redis) until exit."""
    control = Celery(broker=stack.redis_url).control
    # Addressed to the job worker alone (the node name the Procfile gives it by default).
    node = [f"worker@{socket.gethostname()}"]
    replies = control.cancel_consumer(queue, destination=node, reply=True, timeout=10)
    assert replies, "the worker did not answer cancel_consumer"
    try:
        yield
    finally:
        assert control.add_consumer(queue, destination=node, reply=True, timeout=10)


# 240 new tokens: long enough that a job is still generating while a test acts on it.
LONG_SAMPLING = {"max_tokens": 240, "temperature": 0.0, "ignore_eos": True}


def hot_alias(published: dict[str, AdapterRecord]) -> str:
    """A pinned hot adapter: jobs on it start generating without any load."""
    return next(r.alias for r in published.values() if r.tier == Tier.HOT)


def submit_job(api: httpx.Client, adapter: str, **extra: Any) -> dict[str, Any]:
    """POST a long job (``extra`` overrides body fields); asserts the 202."""
    body = {"adapter": adapter, "prompt": "Summarise the conversation", "sampling": LONG_SAMPLING}
    response = api.post("/v1/jobs", json={**body, **extra})
    assert response.status_code == 202, response.text
    accepted: dict[str, Any] = response.json()
    return accepted


def wait_job(api: httpx.Client, job_id: str) -> dict[str, Any]:
    """The job once terminal (long-poll)."""
    job: dict[str, Any] = api.get(f"/v1/jobs/{job_id}", params={"wait_s": 60}, timeout=90).json()
    return job


def new_job(**fields: Any) -> JobPublic:
    """A job record of tenant ``t`` for adapter ``a`` on the hot tier, ``queued`` unless
    ``fields`` say otherwise (for the record scripts, which never look at the adapter)."""
    defaults: dict[str, Any] = {
        "id": uuid.uuid4().hex,
        "status": JobStatus.QUEUED,
        "adapter": "a",
        "revision": "sha256:" + "0" * 64,
        "tenant": "t",
        "tier": Tier.HOT,
        "queue": queue_for(Tier.HOT, "sha256:" + "b" * 64),
        "created_at": datetime.now(tz=UTC),
    }
    return JobPublic(**(defaults | fields))


def queued_messages(redis: Redis) -> int:
    """Messages waiting in every lorafleet queue (pool, worker and webhook queues alike)."""
    return sum(
        int(redis.llen(key))  # type: ignore[arg-type]
        for key in redis.scan_iter(f"{QUEUE_PREFIX}*", _type="list")
    )


def pool_ledger_entries(redis: Redis) -> int:
    """Entries in every pool queue's admission ledger."""
    return sum(
        int(redis.zcard(key))  # type: ignore[arg-type]
        for key in redis.scan_iter(queue_ledger_key("*"))
    )


def job_records(redis: Redis) -> int:
    """How many job records Redis holds (a withdrawn job's tombstone has none)."""
    return sum(1 for key in redis.scan_iter("lorafleet:job:*") if redis.hexists(key, "record"))


def job_record(redis: Redis, job_id: str) -> JobPublic:
    """The job's record, read from Redis directly."""
    job = job_of(redis.hmget(job_key(job_id), RECORD_FIELDS))  # type: ignore[arg-type]
    assert job is not None, f"no record for job {job_id}"
    return job


def job_when(
    redis: Redis, job_id: str, until: Callable[[JobPublic], bool], timeout_s: float = 60
) -> JobPublic:
    """The job as soon as ``until`` holds, woken by keyspace notifications on its record (the
    test Redis enables them): a job may run for only ~1 s, and polling from a busy test
    process can miss that window."""
    pubsub = redis.pubsub(ignore_subscribe_messages=True)
    pubsub.subscribe(f"__keyspace@0__:{job_key(job_id)}")
    try:
        deadline = time.monotonic() + timeout_s
        while not until(job := job_record(redis, job_id)):
            assert time.monotonic() < deadline, f"job {job_id} stuck: {job.model_dump_json()}"
            pubsub.get_message(timeout=0.5)
        return job
    finally:
        pubsub.close()


def worker_heartbeat(redis: Redis) -> dict[str, Any]:
    """The (single) worker's latest announcement."""
    worker_id = next(iter(redis.smembers(WORKERS_INDEX)))  # type: ignore[arg-type]
    record: dict[str, Any] = json.loads(redis.get(worker_key(str(worker_id))))  # type: ignore[arg-type]
    return record


def fresh_heartbeat(redis: Redis, timeout_s: float = 30.0) -> dict[str, Any]:
    """The worker's first announcement written after this call (counters up to date)."""
    since = time.time()
    deadline = time.monotonic() + timeout_s
    while (beat := worker_heartbeat(redis))["seen_at"] <= since:
        assert time.monotonic() < deadline, "the worker stopped announcing itself"
        time.sleep(0.1)
    return beat


def assert_engine_drains(redis: Redis, timeout_s: float = 30.0) -> None:
    """A heartbeat written from now on reports an engine with no unfinished request."""
    since = time.time()
    deadline = time.monotonic() + timeout_s
    while True:
        beat = worker_heartbeat(redis)
        if beat["seen_at"] > since and beat["engine_unfinished_requests"] == 0:
            return
        assert time.monotonic() < deadline, f"the engine still holds requests: {beat}"
        time.sleep(0.1)


def terminal_events(pubsub: Any, quiet_s: float = 1.0) -> Counter[str]:
    """Job ids published on the job-events channel until it stays quiet for ``quiet_s``."""
    seen: Counter[str] = Counter()
    quiet_until = time.monotonic() + quiet_s
    while time.monotonic() < quiet_until:
        message = pubsub.get_message(timeout=0.1)
        if message is not None and message["type"] == "message":
            seen[str(message["data"])] += 1
            quiet_until = time.monotonic() + quiet_s
    return seen


def fixture_publisher(registry: Registry, infra: LocalStack, fixtures_dir: Path) -> Publisher:
    """The fixture model's publisher, into ``registry`` and the session's bucket."""
    return Publisher(
        base_dir=fixtures_dir / "base",
        base_model_id=str(fixtures_dir / "base"),
        limits=infra.settings.limits,
        registry=registry,
        s3=infra.s3(),
        bucket=infra.settings.s3_bucket,
    )


QV = ("q_proj", "v_proj")


def new_adapter(
    parent: Path,
    name: str,
    seed: int,
    fixtures_dir: Path,
    rank: int = 8,
    targets: tuple[str, ...] = QV,
) -> AdapterSpec:
    """Write a new adapter of the test model (``fixtures_dir``'s base) to ``parent / name``:
    its weights drawn from ``seed``, alpha twice its rank."""
    spec = AdapterSpec(name, seed, rank, 2 * rank, targets)
    write_adapter(parent / name, spec, fixtures_dir / "base")
    return spec
