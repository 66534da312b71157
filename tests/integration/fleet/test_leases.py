"""One attempt at a time per job: a worker that only looks dead (its heartbeat expired while
Redis was away) keeps its jobs, and a worker restarted as the same host and pid is not
mistaken for its dead predecessor.
"""

from __future__ import annotations

import os
import shutil
import signal
import subprocess
import time

import pytest

from contracts.errors import ErrorCode
from contracts.keys import held_key
from lorafleet.processes import Child
from tests.helpers import submit_job
from tests.integration.fleet.conftest import (
    MAX_ATTEMPTS,
    UNACKED,
    Fleet,
    StreamingCompletion,
    engine_core,
    kill_group,
)

STREAMS = 10
IN_POD = ["unshare", "--pid", "--fork", "--mount-proc"]


def _pid_namespaces() -> bool:
    """This machine lets us start a process as pid 1 of its own namespace (needs root)."""
    if shutil.which("unshare") is None:
        return False
    return subprocess.run([*IN_POD, "true"], capture_output=True, timeout=30).returncode == 0


def test_redis_down_longer_than_heartbeats_and_leases_starts_no_second_attempt(
    fleet: Fleet,
) -> None:
    """Redis stops for 10 s, longer than the heartbeat expiry (6 s) and the lease (8 s), while
    10 streamed jobs generate: every worker looks dead to every reaper, and every running job
    looks unclaimed, once Redis is back. Each job still has exactly one attempt that
    generated, each client's stream is the job's final text, and nothing is exhausted."""
    streams = [StreamingCompletion(fleet) for _ in range(STREAMS)]
    for stream in streams:
        stream.start()
    jobs = [stream.started() for stream in streams]
    deadline = time.monotonic() + 60
    while not all(fleet.stream_text(job_id) for job_id in jobs):
        assert time.monotonic() < deadline, "the jobs never all generated"
        time.sleep(0.02)  # every job has streamed text: all are generating
    workers = fleet.workers()

    fleet.stack.restart_redis(down_s=10)  # AOF on: keys whose expiry passed are gone after it

    for stream in streams:
        stream.join(timeout=300)
        assert not stream.is_alive()
    for stream, job_id in zip(streams, jobs, strict=True):
        job = fleet.wait_finished(job_id)
        assert job.status == "succeeded", job.model_dump_json()
        assert job.attempts == 1, job.model_dump_json()
        assert job.result is not None
        assert len(fleet.stream_attempts(job_id)) == 1  # one execution wrote text
        assert fleet.stream_text(job_id) == job.result.text
        assert (stream.done, stream.error) == (True, None)
        assert stream.text == job.result.text
        assert job.error is None or job.error.code != ErrorCode.ATTEMPTS_EXHAUSTED
    assert all(worker.alive() for worker in workers), "a worker restarted instead of riding it out"
    assert fleet.admitted() == {"tier": 0, "tenant": 0}


def test_an_attempt_that_lost_its_lease_leaves_the_delivery_to_the_attempt_that_took_it(
    fleet: Fleet,
) -> None:
    """Worker A runs a job and stalls (SIGSTOP) past its heartbeat and its lease: B's reaper
    hands the message back, B receives it (the broker's record of it is under the same
    delivery tag as A's) and claims the job. A wakes, finds its lease lost and stops its
    attempt; its ack must leave the broker's record alone, for it is B's now. Then B dies:
    its delivery must be handed back again, and the job end at once (its third attempt of
    two allowed: ``attempts_exhausted``), not stay running until its deadline."""
    workers = fleet.workers()
    assert len(workers) == 2, [worker.name for worker in workers]
    # Both engines held: the job stays in whichever engine it reaches, so it outlasts all
    # of this (well within the engine probe's 60 s).
    cores = [engine_core(worker) for worker in workers]
    for core in cores:
        core.suspend()
    second = workers[1]
    try:
        job_id = submit_job(fleet.api, fleet.alias)["id"]
        first = fleet.worker_running(fleet.wait_job(job_id, lambda j: j.worker is not None, 60))
        second = next(worker for worker in workers if worker is not first)
        second_id = fleet.worker_id(second)
        os.kill(first.pid, signal.SIGSTOP)  # its Python only: no heartbeat, no lease renewal
        try:
            taken = fleet.wait_job(job_id, lambda job: job.worker == second_id, 60)
        finally:
            os.kill(first.pid, signal.SIGCONT)
        assert taken.attempts == 2, taken.model_dump_json()
        held = fleet.redis.hgetall(held_key(second_id))
        tags = [tag for tag, task_id in held.items() if task_id == job_id]  # type: ignore[union-attr]
        assert len(tags) == 1, held
        # A finds its lease gone at its next renewal (every 2 s), stops its attempt and acks.
        acked = f"delivery {tags[0]}: its record is another worker's now; left in place"
        deadline = time.monotonic() + 30
        while acked not in first.log_path.read_text():
            assert time.monotonic() < deadline, first.log_tail()
            time.sleep(0.1)
        assert fleet.redis.hexists(UNACKED[0], tags[0]), "A's ack removed B's delivery"
        assert fleet.job(job_id).worker == second_id
        kill_group(second)  # its engine still held: the job cannot finish there first
    finally:
        for core in cores:
            if core.is_running():
                core.resume()
        if not second.alive():
            fleet.replace([second])
    # A's reaper hands B's delivery back within a heartbeat expiry and a sweep, long before
    # the deadline; A receives it and ends the job, its attempts spent.
    ended = fleet.wait_job(job_id, lambda job: job.status.terminal, 60)
    assert ended.status == "failed", ended.model_dump_json()
    assert ended.error is not None and ended.error.code == ErrorCode.ATTEMPTS_EXHAUSTED
    assert ended.attempts == MAX_ATTEMPTS
    # The delivery that ended it was acknowledged: nothing of the job's is left to restore.
    # (Only this delivery: an earlier test's ack lost to its Redis restart may still be there.)
    deadline = time.monotonic() + 30
    while fleet.redis.hexists(UNACKED[0], tags[0]):
        assert time.monotonic() < deadline, "the last delivery was never acknowledged"
        time.sleep(0.1)
    assert fleet.admitted() == {"tier": 0, "tenant": 0}


@pytest.mark.skipif(not _pid_namespaces(), reason="needs pid namespaces (unshare, as root)")
def test_worker_restarted_as_the_same_host_and_pid_gets_its_predecessors_jobs_back(
    fleet: Fleet,
) -> None:
    """A container restarted in its pod: same hostname, and its main process is pid 1 again,
    back before its predecessor's heartbeat expired (a long heartbeat here, so that nothing
    but the new process could notice). The new process must not take its dead predecessor
    for itself: it restores the jobs the predecessor held at its first reaper sweep."""
    # Heartbeat expiry 4 x 30 + 2 s: longer than a restart, so no other reaper steps in.
    in_pod = {"LORAFLEET_HEARTBEAT_S": "30", "LORAFLEET_VISIBILITY_TIMEOUT_S": "400"}
    others = fleet.workers()
    fleet.pause(others)
    pod: list[Child] = []
    try:
        first = fleet.spawn_worker(in_pod, wrapper=IN_POD)
        pod.append(first)
        first_id = fleet.stack.wait_worker(first)
        assert first_id.split(":")[1] == "1", first_id  # pid 1, as in a container
        jobs = [submit_job(fleet.api, fleet.alias)["id"] for _ in range(4)]
        fleet.wait_all_running(jobs)
        assert {fleet.job(job_id).worker for job_id in jobs} == {first_id}
        kill_group(first)

        second = fleet.spawn_worker(in_pod, wrapper=IN_POD)
        pod.append(second)
        second_id = fleet.stack.wait_worker(second)
        assert second_id.split(":")[:2] == first_id.split(":")[:2]  # same host, same pid
        assert second_id != first_id
        deadline = time.monotonic() + 30
        while any(fleet.job(job_id).worker != second_id for job_id in jobs):
            assert time.monotonic() < deadline, [fleet.job(j).model_dump_json() for j in jobs]
            time.sleep(0.1)
        for job_id in jobs:
            job = fleet.wait_finished(job_id)
            assert job.status == "succeeded", job.model_dump_json()
            assert (job.attempts, job.worker) == (2, second_id)
    finally:
        fleet.resume(others)
        for worker in pod:
            if worker.alive():
                kill_group(worker)
