"""Delivery guarantees with real processes: a fleet of two workers on a Redis with persistence.

Killed workers (SIGKILL of the whole process group), a job that kills its worker every time,
SIGTERM during a batch, and a Redis restart. The timeouts are shortened through settings; the
production defaults and how they relate are in the README ("Delivery guarantees").
"""

from __future__ import annotations

import os
import signal
import socket
import time
from collections import Counter
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest
from celery import Celery
from kombu.exceptions import OperationalError
from redis.exceptions import RedisError

from contracts.jobs import JobPublic
from contracts.keys import JOB_EVENTS, tenant_ledger_key, tier_ledger_key, worker_key
from contracts.queues import Tier, queue_for
from lorafleet.fixtures import AdapterSpec
from lorafleet.processes import Child
from lorafleet.settings import LocalSettings
from lorafleet.stack import DEV_TENANT, LocalStack
from tests.helpers import job_record, job_when, submit_job

DEADLINE_S = 30
MAX_ATTEMPTS = 2
FLEET_ENV = {
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
}
QUEUE = queue_for(Tier.HOT)
# Kombu's Redis transport keeps delivered, unacknowledged messages here.
UNACKED = ("unacked", "unacked_index")


class Fleet:
    """A local stack with two workers that tests may kill and replace."""

    def __init__(self, stack: LocalStack, alias: str, api: httpx.Client) -> None:
        self.stack = stack
        self.alias = alias
        self.api = api  # the stack's gateway, as its ``dev`` tenant
        self.redis = stack.redis()
        self.control = Celery(broker=stack.redis_url).control
        self._spawned = 0

    def spawn_worker(self, env: dict[str, str] | None = None) -> Child:
        self._spawned += 1
        name = f"fleet-worker-{self._spawned}"
        return self.stack.spawn_worker(
            {**FLEET_ENV, **(env or {}), "LORAFLEET_WORKER_NAME": f"{name}@%h"}, name=name
        )

    def workers(self) -> list[Child]:
        return [c for c in self.stack.children if c.name.startswith("fleet-worker") and c.alive()]

    def worker_running(self, job: JobPublic) -> Child:
        return next(c for c in self.workers() if self.stack.worker_id(c) == job.worker)

    @staticmethod
    def node(worker: Child) -> str:
        return f"{worker.name}@{socket.gethostname()}"

    def job(self, job_id: str) -> JobPublic:
        return job_record(self.redis, job_id)

    def wait_job(
        self,
        job_id: str,
        until: Callable[[JobPublic], bool],
        timeout_s: float,
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
        while not any(
            self.redis.exists(worker_key(self.stack.worker_id(worker))) for worker in self.workers()
        ):
            assert time.monotonic() < deadline, "no worker came back"
            time.sleep(0.2)

    def unacked(self) -> int:
        return sum(int(self.redis.exists(key)) for key in UNACKED)

    def admitted(self) -> dict[str, int]:
        """Jobs counted against the admission limits (tier and tenant ledgers)."""
        keys = {"tier": tier_ledger_key(Tier.HOT.value), "tenant": tenant_ledger_key(DEV_TENANT)}
        return {name: int(self.redis.zcard(key)) for name, key in keys.items()}  # type: ignore[arg-type]


@pytest.fixture(scope="module")
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


def _replace(fleet: Fleet, killed: list[Child]) -> None:
    """Start a worker for each killed one and wait until they all consume."""
    for worker in [fleet.spawn_worker() for _ in killed]:
        fleet.stack.wait_worker(worker)


def _terminal_events(pubsub: Any, quiet_s: float = 1.0) -> Counter[str]:
    """Job ids published on the job-events channel until it stays quiet for ``quiet_s``."""
    seen: Counter[str] = Counter()
    quiet_until = time.monotonic() + quiet_s
    while time.monotonic() < quiet_until:
        message = pubsub.get_message(timeout=0.1)
        if message is not None and message["type"] == "message":
            seen[str(message["data"])] += 1
            quiet_until = time.monotonic() + quiet_s
    return seen


def test_worker_killed_mid_job_its_jobs_run_again_elsewhere_exactly_once(fleet: Fleet) -> None:
    events = fleet.redis.pubsub(ignore_subscribe_messages=True)
    events.subscribe(JOB_EVENTS)
    # Enough long jobs that both workers are busy with several when one of them dies.
    accepted = [submit_job(fleet.api, fleet.alias)["id"] for _ in range(24)]
    # Every job started (so received and recorded by its worker) before the kill.
    fleet.wait_none_queued(accepted)
    victim = fleet.worker_running(fleet.first_running(accepted))
    victim_id = fleet.stack.worker_id(victim)
    os.killpg(victim.pid, signal.SIGKILL)  # the worker and its engine, no cleanup at all
    victim.process.wait(timeout=10)
    # What the dead worker had started, as it left it: each of these must run once more.
    orphaned = {
        job_id
        for job_id in accepted
        if (job := fleet.job(job_id)).status == "running" and job.worker == victim_id
    }
    assert orphaned

    finished = {job_id: fleet.wait_finished(job_id) for job_id in accepted}
    for job_id, job in finished.items():
        assert job.status == "succeeded", job.model_dump_json()
        if job_id in orphaned:  # started on the victim, finished by the other worker
            assert (job.attempts, job.worker != victim_id) == (2, True)
        else:  # finished before the kill, or only ever delivered to the survivor
            assert job.attempts == 1
        assert job.metadata is not None and job.metadata.identity_verified
    # One result each: exactly one terminal transition was published per job.
    counts = _terminal_events(events)
    assert {job_id: counts[job_id] for job_id in accepted} == dict.fromkeys(accepted, 1)
    events.close()
    assert fleet.unacked() == 0
    assert fleet.redis.llen(QUEUE) == 0
    # Redelivery released the admission slots once each: the counts are back to zero.
    assert fleet.admitted() == {"tier": 0, "tenant": 0}
    _replace(fleet, [victim])


def test_job_that_kills_its_worker_every_time_stops_after_max_attempts(fleet: Fleet) -> None:
    alongside = submit_job(fleet.api, fleet.alias, sampling={"max_tokens": 4})["id"]
    poison = submit_job(fleet.api, fleet.alias)["id"]
    killed: list[Child] = []
    later: list[str] = []
    for attempt in range(1, MAX_ATTEMPTS + 1):
        running = job_when(
            fleet.redis,
            poison,
            lambda job, n=attempt: job.status == "running" and job.attempts == n,
            120,
        )
        worker = fleet.worker_running(running)
        os.killpg(worker.pid, signal.SIGKILL)
        worker.process.wait(timeout=10)
        killed.append(worker)
        fleet.spawn_worker()  # a supervisor restarts it; the poison may land there again
        # Other jobs keep flowing while the poison waits. Both workers may be down right
        # after this kill (the other died on the previous attempt and is still restarting):
        # submit once one consumes, or the job would wait out its 30 s deadline.
        fleet.wait_any_consuming()
        later.append(submit_job(fleet.api, fleet.alias, sampling={"max_tokens": 4})["id"])

    job = fleet.wait_finished(poison)
    assert job.status == "failed"
    assert job.error is not None and job.error.code == "attempts_exhausted"
    assert job.attempts == MAX_ATTEMPTS
    assert job.result is None
    for job_id in [alongside, *later]:
        assert fleet.wait_finished(job_id).status == "succeeded"
    assert fleet.admitted() == {"tier": 0, "tenant": 0}
    for worker in fleet.workers():
        fleet.stack.wait_worker(worker)
    assert len(fleet.workers()) == 2


def test_sigterm_drains_a_batch_of_running_jobs_and_exits_zero(fleet: Fleet) -> None:
    target, other = fleet.workers()[:2]
    both = [fleet.node(target), fleet.node(other)]
    # The batch queues up while nobody consumes, then goes to ``target`` alone, all at once.
    assert len(fleet.control.cancel_consumer(QUEUE, destination=both, reply=True)) == 2
    try:
        batch = [submit_job(fleet.api, fleet.alias)["id"] for _ in range(20)]
        assert fleet.control.add_consumer(QUEUE, destination=[fleet.node(target)], reply=True)
        deadline = time.monotonic() + 60
        while not all(fleet.job(job_id).status == "running" for job_id in batch):
            assert time.monotonic() < deadline, "the batch never ran all at once"
        os.kill(target.pid, signal.SIGTERM)  # what an orchestrator sends the main process
        assert target.process.wait(timeout=120) == 0, target.log_tail()
        for job_id in batch:
            job = fleet.job(job_id)
            assert job.status == "succeeded", job.model_dump_json()
            assert job.worker == fleet.stack.worker_id(target)
            assert job.attempts == 1
        assert fleet.unacked() == 0
        assert fleet.redis.llen(QUEUE) == 0
    finally:
        assert fleet.control.add_consumer(QUEUE, destination=[fleet.node(other)], reply=True)
    _replace(fleet, [target])


def test_sigterm_past_the_drain_timeout_hands_running_jobs_to_another_worker(
    fleet: Fleet,
) -> None:
    others = fleet.workers()
    nodes = [fleet.node(worker) for worker in others]
    assert len(fleet.control.cancel_consumer(QUEUE, destination=nodes, reply=True)) == 2
    try:
        impatient = fleet.spawn_worker({"LORAFLEET_DRAIN_TIMEOUT_S": "0.5"})
        fleet.stack.wait_worker(impatient)
        batch = [submit_job(fleet.api, fleet.alias)["id"] for _ in range(8)]
        deadline = time.monotonic() + 60
        while not all(fleet.job(job_id).status == "running" for job_id in batch):
            assert time.monotonic() < deadline, "the batch never ran all at once"
        os.kill(impatient.pid, signal.SIGTERM)
        assert impatient.process.wait(timeout=60) == 0, impatient.log_tail()
        for job_id in batch:  # handed back: queued again, the interrupted attempt uncounted
            job = fleet.job(job_id)
            assert (job.status, job.attempts) == ("queued", 0), job.model_dump_json()
        assert fleet.redis.llen(QUEUE) == len(batch)
        assert fleet.unacked() == 0
    finally:
        assert len(fleet.control.add_consumer(QUEUE, destination=nodes, reply=True)) == 2
    for job_id in batch:
        job = fleet.wait_finished(job_id)
        assert job.status == "succeeded", job.model_dump_json()
        assert job.attempts == 1
        assert job.worker != fleet.stack.worker_id(impatient)


def test_jobs_queued_before_a_redis_restart_run_after_it(fleet: Fleet) -> None:
    workers = fleet.workers()
    nodes = [fleet.node(worker) for worker in workers]
    assert len(fleet.control.cancel_consumer(QUEUE, destination=nodes, reply=True)) == 2
    queued = [
        submit_job(fleet.api, fleet.alias, sampling={"max_tokens": 4})["id"] for _ in range(5)
    ]
    assert fleet.redis.llen(QUEUE) == 5

    fleet.stack.restart_redis()  # clean shutdown; the append-only file brings the queue back
    assert fleet.redis.llen(QUEUE) == 5
    # The workers reconnect on their own; once their control channel is back, resume.
    deadline = time.monotonic() + 90
    while True:
        control = Celery(broker=fleet.stack.redis_url).control  # a fresh broker connection
        try:
            if len(control.add_consumer(QUEUE, destination=nodes, reply=True, timeout=2)) == 2:
                break
        except (ConnectionError, OSError, RedisError, OperationalError):
            pass
        assert time.monotonic() < deadline, "the workers did not come back after the restart"
        time.sleep(0.5)
    for job_id in queued:
        job = fleet.wait_finished(job_id, timeout_s=90)
        assert job.status == "succeeded", job.model_dump_json()
    assert all(worker.alive() for worker in workers), "a worker restarted instead of reconnecting"
    # The gateway reconnected as well.
    response = fleet.api.get(f"/v1/jobs/{queued[0]}")
    assert response.status_code == 200
