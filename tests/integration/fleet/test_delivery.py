"""Delivery guarantees with real processes: a fleet of two workers on a Redis with persistence.

Killed workers (SIGKILL of the whole process group), a job that kills its worker every time,
SIGTERM during a batch, and a Redis restart with nothing running.
"""

from __future__ import annotations

import os
import signal
import time

from celery import Celery
from kombu.exceptions import OperationalError
from redis.exceptions import RedisError

from contracts.keys import JOB_EVENTS
from lorafleet.processes import Child
from tests.helpers import job_when, submit_job, terminal_events
from tests.integration.fleet.conftest import (
    MAX_ATTEMPTS,
    Fleet,
    kill_group,
)


def test_worker_killed_mid_job_its_jobs_run_again_elsewhere_exactly_once(fleet: Fleet) -> None:
    events = fleet.redis.pubsub(ignore_subscribe_messages=True)
    events.subscribe(JOB_EVENTS)
    # Enough long jobs that both workers are busy with several when one of them dies.
    accepted = [submit_job(fleet.api, fleet.alias)["id"] for _ in range(24)]
    # Every job started (so received and recorded by its worker) before the kill.
    fleet.wait_none_queued(accepted)
    victim = fleet.worker_running(fleet.first_running(accepted))
    victim_id = fleet.worker_id(victim)
    kill_group(victim)
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
    counts = terminal_events(events)
    assert {job_id: counts[job_id] for job_id in accepted} == dict.fromkeys(accepted, 1)
    events.close()
    assert fleet.unacked() == 0
    assert fleet.redis.llen(fleet.queue) == 0
    # Redelivery released the admission slots once each: the counts are back to zero.
    assert fleet.admitted() == {"tier": 0, "tenant": 0}
    fleet.replace([victim])


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
        kill_group(worker)
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
    target_id = fleet.worker_id(target)
    # The batch queues up while nobody consumes, then goes to ``target`` alone, all at once.
    fleet.pause([target, other])
    try:
        batch = [submit_job(fleet.api, fleet.alias)["id"] for _ in range(20)]
        fleet.resume([target])
        fleet.wait_all_running(batch)
        os.kill(target.pid, signal.SIGTERM)  # what an orchestrator sends the main process
        assert target.process.wait(timeout=120) == 0, target.log_tail()
        for job_id in batch:
            job = fleet.job(job_id)
            assert job.status == "succeeded", job.model_dump_json()
            assert job.worker == target_id
            assert job.attempts == 1
        assert fleet.unacked() == 0
        assert fleet.redis.llen(fleet.queue) == 0
    finally:
        fleet.resume([other])
    fleet.replace([target])


def test_sigterm_past_the_drain_timeout_hands_running_jobs_to_another_worker(
    fleet: Fleet,
) -> None:
    others = fleet.workers()
    fleet.pause(others)
    try:
        impatient = fleet.spawn_worker({"LORAFLEET_DRAIN_TIMEOUT_S": "0.5"})
        impatient_id = fleet.stack.wait_worker(impatient)
        batch = [submit_job(fleet.api, fleet.alias)["id"] for _ in range(8)]
        fleet.wait_all_running(batch)
        os.kill(impatient.pid, signal.SIGTERM)
        assert impatient.process.wait(timeout=60) == 0, impatient.log_tail()
        for job_id in batch:  # handed back: queued again, the interrupted attempt uncounted
            job = fleet.job(job_id)
            assert (job.status, job.attempts) == ("queued", 0), job.model_dump_json()
        assert fleet.redis.llen(fleet.queue) == len(batch)
        assert fleet.unacked() == 0
    finally:
        fleet.resume(others)
    for job_id in batch:
        job = fleet.wait_finished(job_id)
        assert job.status == "succeeded", job.model_dump_json()
        assert job.attempts == 1
        assert job.worker != impatient_id


def test_jobs_queued_before_a_redis_restart_run_after_it(fleet: Fleet) -> None:
    workers = fleet.workers()
    nodes = [fleet.node(worker) for worker in workers]
    fleet.pause(workers)
    queued = [
        submit_job(fleet.api, fleet.alias, sampling={"max_tokens": 4})["id"] for _ in range(5)
    ]
    # A pause takes effect between two of a worker's waits for messages (up to 1 s): one
    # already waiting may still take a job. Those left are what the restart must keep.
    time.sleep(2)
    waiting = sum(fleet.job(job_id).status == "queued" for job_id in queued)
    assert waiting >= 3 and fleet.redis.llen(fleet.queue) == waiting

    fleet.stack.restart_redis()  # clean shutdown; the append-only file brings the queue back
    assert fleet.redis.llen(fleet.queue) == waiting
    # The workers reconnect on their own; once their control channel is back, resume.
    deadline = time.monotonic() + 90
    while True:
        control = Celery(broker=fleet.stack.redis_url).control  # a fresh broker connection
        try:
            if (
                len(control.add_consumer(fleet.queue, destination=nodes, reply=True, timeout=2))
                == 2
            ):
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
