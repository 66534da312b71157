"""A fleet of real workers on a Redis with persistence, for fault tests that kill, wedge,
restart and partition them. The timeouts are shortened through settings; the production
defaults and how they relate are in the README ("Delivery guarantees").

One fleet serves every module of this package: each test leaves two live workers behind.
"""

from __future__ import annotations

import json
import os
import signal
import socket
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import httpx
import psutil
import pytest
from celery import Celery

from contracts.digests import manifest_of
from contracts.jobs import JobPublic
from contracts.keys import queue_ledger_key, stream_key, tenant_ledger_key
from contracts.queues import Tier, queue_for
from lorafleet.fixtures import AdapterSpec
from lorafleet.processes import Child
from lorafleet.settings import LocalSettings
from lorafleet.stack import DEV_TENANT, LocalStack
from tests.helpers import job_record

# Long enough for jobs handed back after an engine failure to wait for a replacement worker.
DEADLINE_S = 120
MAX_ATTEMPTS = 2
FLEET_ENV = {
    # These tests are about delivery through the shared queue (pausing its consumers, counting
    # it); routing to workers' own queues is tested in tests/integration/test_fleet_routing.py.
    "LORAFLEET_ROUTING": "false",
    "LORAFLEET_JOB_DEADLINE_S": str(DEADLINE_S),
    # A dead worker's jobs go back to their queue ~7 s after its last heartbeat (4 beats + 2 s,
    # then the next reaper sweep), well before their deadline.
    "LORAFLEET_HEARTBEAT_S": "1",
    "LORAFLEET_RESTORE_INTERVAL_S": "1",
    # The backstop, above deadline + announcement TTL + restore interval as settings require.
    "LORAFLEET_VISIBILITY_TIMEOUT_S": str(DEADLINE_S + 15),
    "LORAFLEET_MAX_ATTEMPTS": str(MAX_ATTEMPTS),
    "LORAFLEET_DRAIN_TIMEOUT_S": "60",
    "LORAFLEET_CANCEL_POLL_S": "0.5",
    "LORAFLEET_WORKER_CONCURRENCY": "32",
    "LORAFLEET_MAX_LORAS": "2",
    "LORAFLEET_MAX_CPU_LORAS": "2",
    # Leases renewed every 2 s; a dead worker's running jobs wait up to 8 s for theirs.
    "LORAFLEET_LEASE_TTL_S": "8",
    "LORAFLEET_ENGINE_PROBE_S": "1",
    # Generous: on a loaded 2-core machine a busy engine can take seconds to answer, and
    # CI has seen the worker that took a failed worker's jobs go 30 s without a step's output
    # (three engines' model workers bound to one core; cause not established: a probe that
    # times out now logs what the engine's processes and the host were doing). The engine
    # fault tests give the worker whose engine they wedge the production default, 30 s.
    "LORAFLEET_ENGINE_PROBE_TIMEOUT_S": "60",
    "LORAFLEET_ENGINE_FAILURE_EXIT_S": "30",
    "LORAFLEET_SWEEP_INTERVAL_S": "1",
    "LORAFLEET_SWEEP_GRACE_S": "2",
}
REPLY_S = 10.0
"""How long a remote-control command waits for the workers' replies."""
RECONNECT_S = 90.0
"""How long a worker may take to answer remote control again after a Redis restart."""
# Kombu's Redis transport keeps delivered, unacknowledged messages here.
UNACKED = ("unacked", "unacked_index")


class Fleet:
    """A local stack with workers that tests may kill and replace."""

    def __init__(self, stack: LocalStack, alias: str, api: httpx.Client) -> None:
        self.stack = stack
        self.alias = alias
        self.api = api  # the stack's gateway, as its ``dev`` tenant
        self.redis = stack.redis()
        self._spawned = 0
        base = manifest_of(stack.model).digest()
        self.queue = queue_for(Tier.HOT, base)
        """The hot pool queue the fleet's workers take (the tests' adapter is hot)."""

    def spawn_worker(
        self, env: dict[str, str] | None = None, wrapper: list[str] | None = None
    ) -> Child:
        self._spawned += 1
        name = f"fleet-worker-{self._spawned}"
        # One worker process per cache directory, as the disk cache requires.
        cache = str(self.stack.state_dir / f"cache-{name}")
        return self.stack.spawn_worker(
            {
                **FLEET_ENV,
                "LORAFLEET_CACHE_DIR": cache,
                **(env or {}),
                "LORAFLEET_WORKER_NAME": f"{name}@%h",
            },
            name=name,
            wrapper=wrapper,
        )

    def workers(self) -> list[Child]:
        return [c for c in self.stack.children if c.name.startswith("fleet-worker") and c.alive()]

    def worker_id(self, worker: Child) -> str:
        worker_id = self.stack.worker_id(worker)
        assert worker_id is not None, f"{worker.name} is not announced"
        return worker_id

    def worker_running(self, job: JobPublic) -> Child:
        assert job.worker is not None, job.model_dump_json()
        return self.worker_announced_as(job.worker)

    def worker_announced_as(self, worker_id: str) -> Child:
        """The live worker announced under ``worker_id``."""
        return next(c for c in self.workers() if self.stack.worker_id(c) == worker_id)

    @staticmethod
    def node(worker: Child) -> str:
        return f"{worker.name}@{socket.gethostname()}"

    def _broadcast(self, command: str, workers: list[Child]) -> None:
        """``command`` (cancel_consumer, add_consumer) to ``workers``; each must answer. A
        loaded machine answers slowly, hence the long reply window; a worker whose broker
        connection is coming back after a Redis restart answers only once its consumer
        reconnected (kombu backs off up to ~12 s after a 10 s outage), hence the retries to
        those that have not answered yet. A worker still starting (a test's replacement for
        one it killed) answers only once its engine is up and it consumes: waited for first
        (CI, 2026-12-06: a replacement spawned a second earlier did not answer in 90 s)."""
        for worker in workers:
            self.stack.wait_worker(worker)
        pending = {self.node(worker) for worker in workers}
        deadline = time.monotonic() + RECONNECT_S
        app = Celery(broker=self.stack.redis_url)
        while pending:  # an empty destination would address every worker
            # A connection of its own: Celery's pool is kombu's process-wide one, keyed by
            # URL, and a connection pooled before a Redis restart fails its next health check.
            with app.connection_for_write() as connection:
                replies = getattr(app.control, command)(
                    self.queue,
                    destination=sorted(pending),
                    reply=True,
                    timeout=REPLY_S,
                    connection=connection,
                )
            for reply in replies:
                pending -= set(reply)
            assert not pending or time.monotonic() < deadline, f"{sorted(pending)} never answered"

    def pause(self, workers: list[Child]) -> None:
        """``workers`` stop consuming the queue."""
        self._broadcast("cancel_consumer", workers)

    def resume(self, workers: list[Child]) -> None:
        self._broadcast("add_consumer", workers)

    def job(self, job_id: str) -> JobPublic:
        return job_record(self.redis, job_id)

    def wait_job(
        self, job_id: str, until: Callable[[JobPublic], bool], timeout_s: float
    ) -> JobPublic:
        deadline = time.monotonic() + timeout_s
        while True:
            job = self.job(job_id)
            if until(job):
                return job
            assert time.monotonic() < deadline, f"job {job_id} stuck: {job.model_dump_json()}"
            time.sleep(0.05)

    def first_running(self, job_ids: list[str], timeout_s: float = 60) -> JobPublic:
        """The first of ``job_ids`` seen running (polled fast: a job may run ~1 s)."""
        deadline = time.monotonic() + timeout_s
        while True:
            for job_id in job_ids:
                if (job := self.job(job_id)).status == "running":
                    return job
            assert time.monotonic() < deadline, "no job started"

    def wait_all_running(self, job_ids: list[str], timeout_s: float = 60) -> None:
        deadline = time.monotonic() + timeout_s
        while not all(self.job(job_id).status == "running" for job_id in job_ids):
            assert time.monotonic() < deadline, "the jobs never ran all at once"
            time.sleep(0.05)

    def wait_in_engine(
        self, worker: Child, count: int, jobs: list[str] | None = None, timeout_s: float = 60
    ) -> None:
        """Until ``worker``'s engine holds ``count`` requests (its heartbeat says so); if
        ``jobs`` are those requests, fails at once when one of them has ended (the engine can
        no longer be seen holding them all)."""
        deadline = time.monotonic() + timeout_s
        while True:
            record = worker_record(self, self.worker_id(worker))
            if record is not None and record["engine_unfinished_requests"] == count:
                return
            ended = [job_id for job_id in jobs or () if self.job(job_id).status != "running"]
            assert not ended, f"jobs ended before their engine was seen holding {count}: {ended}"
            assert time.monotonic() < deadline, f"the engine never held {count}: {record}"
            time.sleep(0.1)

    def wait_none_queued(self, job_ids: list[str], timeout_s: float = 60) -> None:
        deadline = time.monotonic() + timeout_s
        while any(self.job(job_id).status == "queued" for job_id in job_ids):
            assert time.monotonic() < deadline, "jobs still queued"
            time.sleep(0.05)

    def wait_finished(self, job_id: str, timeout_s: float = 180) -> JobPublic:
        return self.wait_job(job_id, lambda job: job.status.terminal, timeout_s)

    def wait_any_consuming(self, timeout_s: float = 600) -> None:
        """Until at least one live worker has announced itself (engine up, consuming)."""
        deadline = time.monotonic() + timeout_s
        while not any(self.stack.worker_id(worker) for worker in self.workers()):
            assert time.monotonic() < deadline, "no worker came back"
            time.sleep(0.2)

    def replace(self, gone: list[Child]) -> None:
        """Start a worker for each one gone and wait until they all consume."""
        for worker in [self.spawn_worker() for _ in gone]:
            self.stack.wait_worker(worker)

    def unacked(self) -> int:
        return sum(int(self.redis.exists(key)) for key in UNACKED)

    def admitted(self) -> dict[str, int]:
        """Jobs counted against the admission limits (pool queue and tenant ledgers)."""
        keys = {"tier": queue_ledger_key(self.queue), "tenant": tenant_ledger_key(DEV_TENANT)}
        return {name: int(self.redis.zcard(key)) for name, key in keys.items()}  # type: ignore[arg-type]

    def stream_attempts(self, job_id: str) -> set[str]:
        """The attempt numbers that appended text to the job's stream."""
        return {fields["attempt"] for fields in self._deltas(job_id)}

    def stream_text(self, job_id: str) -> str:
        return "".join(fields["text"] for fields in self._deltas(job_id))

    def _deltas(self, job_id: str) -> list[dict[str, str]]:
        """The stream's text entries (not the entry that opened it, nor its end marker)."""
        entries = self.redis.xrange(stream_key(job_id))
        return [fields for _, fields in entries if "text" in fields]  # type: ignore[union-attr]


class StreamingCompletion(threading.Thread):
    """A streaming completion read to its end on a thread of its own, as a client would:
    the text it received, the error event if one came, and whether ``[DONE]`` ended it."""

    def __init__(self, fleet: Fleet, **body: Any) -> None:
        super().__init__(daemon=True)
        self._url = fleet.stack.gateway_url
        self._headers = dict(fleet.api.headers)
        self._body = {
            "model": fleet.alias,
            "prompt": "Summarise the conversation",
            "max_tokens": 240,
            "temperature": 0,
            "ignore_eos": True,
            "stream": True,
            **body,
        }
        self.accepted = threading.Event()
        self.job_id = ""
        self.status = 0
        self.text = ""
        self.error: dict[str, Any] | None = None
        self.done = False

    def run(self) -> None:
        with (
            httpx.Client(base_url=self._url, headers=self._headers, timeout=300) as client,
            client.stream("POST", "/v1/completions", json=self._body) as response,
        ):
            self.status = response.status_code
            self.job_id = response.headers.get("x-lorafleet-job-id", "")
            self.accepted.set()
            for line in response.iter_lines():
                if not line.startswith("data: "):
                    continue
                if line == "data: [DONE]":
                    self.done = True
                    return
                event = json.loads(line.removeprefix("data: "))
                if "error" in event:
                    self.error = event["error"]
                for choice in event.get("choices", ()):
                    self.text += choice.get("text") or ""

    def started(self, timeout_s: float = 60) -> str:
        """The job id, once the gateway accepted the request."""
        assert self.accepted.wait(timeout_s), "the completion was never accepted"
        assert self.status == 200, self.status
        return self.job_id


def engine_core(worker: Child) -> psutil.Process:
    """The vLLM engine-core process of ``worker`` (titled ``VLLM::EngineCore``)."""
    for child in psutil.Process(worker.pid).children(recursive=True):
        try:
            if "EngineCore" in " ".join(child.cmdline()):
                return child
        except psutil.Error:
            continue
    raise AssertionError(f"{worker.name} has no engine-core process")


def kill_group(worker: Child) -> None:
    """SIGKILL the worker and its engine: no cleanup at all."""
    os.killpg(worker.pid, signal.SIGKILL)
    worker.process.wait(timeout=10)


def worker_record(fleet: Fleet, worker_id: str) -> dict[str, Any] | None:
    raw = fleet.redis.get(f"lorafleet:worker:{worker_id}")
    return None if raw is None else dict(json.loads(str(raw)))


@pytest.fixture(scope="package")
def fleet(
    tmp_path_factory: pytest.TempPathFactory, fixtures_dir: Path, specs: list[AdapterSpec]
) -> Iterator[Fleet]:
    state = tmp_path_factory.mktemp("fleet")
    settings = LocalSettings(
        state_dir=state, s3_bucket="lorafleet-fleet", redis_url=None, s3_endpoint_url=None
    )
    stack = LocalStack(settings, fixtures_dir / "base", persistent_redis=True)
    try:
        stack.start_infra()
        stack.redis().config_set("notify-keyspace-events", "Kh")  # for ``job_when``
        alias = specs[0].name
        stack.publisher().publish(fixtures_dir / "adapters" / alias, alias, Tier.HOT)
        stack.start_services({**FLEET_ENV, "LORAFLEET_WORKER_NAME": "fleet-worker-0@%h"})
        first = next(c for c in stack.children if c.name == "worker")
        first.name = "fleet-worker-0"
        auth = {"Authorization": f"Bearer {stack.api_key}"}
        with httpx.Client(base_url=stack.gateway_url, headers=auth, timeout=90) as api:
            fleet = Fleet(stack, alias, api)
            stack.wait_worker(fleet.spawn_worker())
            yield fleet
    finally:
        stack.stop()
