"""A worker whose engine dies or hangs stops taking jobs, hands them all back and exits
non-zero; another worker runs them, each exactly once. A job that kills every engine it runs
on is still stopped, without taking the jobs that shared its batches down with it.
"""

from __future__ import annotations

import signal
import time

from contracts.keys import JOB_EVENTS, STREAM_END, held_key, stream_key
from lorafleet.processes import Child
from tests.helpers import submit_job, terminal_events
from tests.integration.fleet.conftest import (
    MAX_ATTEMPTS,
    Fleet,
    StreamingCompletion,
    engine_core,
    worker_record,
)
from tests.sentry_server import recording_sentry, sentry_events

EXIT_ENGINE_FAILED = 75
TARGET_ENV = {"LORAFLEET_HEARTBEAT_S": "0.25"}
"""The worker whose engine a test breaks reports its engine's requests four times a second:
a fast machine ran 8 jobs' 240 tokens between two of the fleet's 1 s heartbeats, and the
engine was never seen holding them all (CI, 2026-12-06)."""
PROBE_TIMEOUT_S = 30
"""The probe timeout of the worker whose engine a test wedges (the production default; the
fleet's other workers wait longer: ``FLEET_ENV``)."""
# Engine failure noticed within ~1 s (dead core) or PROBE_TIMEOUT_S (wedged), plus at most
# the worker's 30 s bound to hand its jobs back and leave.
EXIT_BOUND_S = 90


def _jobs_on(fleet: Fleet, target: Child, count: int) -> list[str]:
    """``count`` long jobs generating on ``target`` (the others paused meanwhile)."""
    workers = fleet.workers()
    others = [worker for worker in workers if worker is not target]
    fleet.pause(workers)
    try:
        jobs = [submit_job(fleet.api, fleet.alias)["id"] for _ in range(count)]
        fleet.resume([target])
        fleet.wait_all_running(jobs)
        fleet.wait_in_engine(target, count, jobs)
    finally:
        fleet.resume(others)
    return jobs


def _exited_unkilled(fleet: Fleet, expected: list[Child]) -> str:
    """Each fleet worker that exited, other than ``expected`` (those gone before the test
    and those it killed): its exit code and its log's last lines (CI once saw one such
    worker, with no other trace)."""
    gone = [
        child
        for child in fleet.stack.children
        if child.name.startswith("fleet-worker") and not child.alive() and child not in expected
    ]
    return "\n".join(
        f"{child.name} exited {child.process.returncode}:\n{child.log_tail(40)}" for child in gone
    )


def _next_execution(fleet: Fleet, job_id: str, seen: list[str]) -> str:
    """The lease value (``worker id|attempt``) of the first execution of ``job_id`` not in
    ``seen`` to append text to its stream, as soon as it does (a blocking read: woken by the
    append itself)."""
    key = stream_key(job_id)
    last = "0-0"
    deadline = time.monotonic() + 240
    while time.monotonic() < deadline:
        for _, entries in fleet.redis.xread({key: last}, block=1000) or []:
            for entry_id, fields in entries:
                last = entry_id
                if STREAM_END in fields:
                    raise AssertionError(f"{job_id} ended: {fleet.job(job_id)}")
                execution = fields.get("attempt")
                if execution is not None and execution not in seen:
                    return str(execution)
    raise AssertionError(f"no new execution of {job_id} generated: {fleet.job(job_id)}")


def _assert_handed_over(
    fleet: Fleet, jobs: list[str], failed: Child, failed_id: str, events: object
) -> None:
    for job_id in jobs:
        job = fleet.wait_finished(job_id)
        # CI once saw a handed-back job's second worker die too (no trace kept): name it.
        assert job.status == "succeeded", (job.model_dump_json(), _exited_unkilled(fleet, [failed]))
        assert job.worker is not None and job.worker != failed_id
        # The interrupted attempt was given back, not counted; the engine death under it was.
        assert (job.attempts, job.engine_failures) == (1, 1), job.model_dump_json()
        assert job.metadata is not None and job.metadata.identity_verified
    counts = terminal_events(events)
    assert {job_id: counts[job_id] for job_id in jobs} == dict.fromkeys(jobs, 1)
    assert fleet.unacked() == 0
    assert fleet.redis.llen(fleet.queue) == 0
    assert fleet.admitted() == {"tier": 0, "tenant": 0}
    assert not fleet.redis.exists(held_key(failed_id))
    assert worker_record(fleet, failed_id) is None


def test_engine_core_killed_hands_every_job_to_another_worker(fleet: Fleet) -> None:
    events = fleet.redis.pubsub(ignore_subscribe_messages=True)
    events.subscribe(JOB_EVENTS)
    with recording_sentry() as (dsn, received):
        target = fleet.spawn_worker({"SENTRY_DSN": dsn, **TARGET_ENV})
        target_id = fleet.stack.wait_worker(target)
        jobs = _jobs_on(fleet, target, 20)

        engine_core(target).send_signal(signal.SIGKILL)  # OOM killer, a CUDA fault: core gone
        started = time.monotonic()
        assert target.process.wait(timeout=EXIT_BOUND_S) == EXIT_ENGINE_FAILED, target.log_tail()
        assert time.monotonic() - started < EXIT_BOUND_S
        reported = [
            event
            for event in sentry_events(received)
            if event.get("tags", {}).get("worker") == target_id
        ]
    _assert_handed_over(fleet, jobs, target, target_id, events)
    events.close()
    assert reported and reported[0]["level"] == "fatal"
    assert "engine failed" in reported[0]["message"]


def test_wedged_engine_is_noticed_by_its_probe_and_its_jobs_run_elsewhere(fleet: Fleet) -> None:
    events = fleet.redis.pubsub(ignore_subscribe_messages=True)
    events.subscribe(JOB_EVENTS)
    target = fleet.spawn_worker(
        {"LORAFLEET_ENGINE_PROBE_TIMEOUT_S": str(PROBE_TIMEOUT_S), **TARGET_ENV}
    )
    target_id = fleet.stack.wait_worker(target)
    jobs = _jobs_on(fleet, target, 8)
    core = engine_core(target)

    # A hung step: the core process is alive (vLLM sees nothing wrong) but never answers.
    core.send_signal(signal.SIGSTOP)
    try:
        assert target.process.wait(timeout=EXIT_BOUND_S) == EXIT_ENGINE_FAILED
    finally:
        if core.is_running():
            core.send_signal(signal.SIGKILL)
    _assert_handed_over(fleet, jobs, target, target_id, events)
    events.close()
    assert "health probe" in target.log_path.read_text()


def test_job_that_kills_every_engine_stops_and_spares_its_batch_mates(fleet: Fleet) -> None:
    """Each time the poison generates, its engine dies (killed here, as a request that crashes
    the engine would). The jobs in the engine with it are handed back too, but only the poison
    keeps dying: after ``MAX_ATTEMPTS`` engine deaths it fails ``attempts_exhausted``, and no
    other job does, although the first death took three of them down with it."""
    while len(fleet.workers()) < 2:  # an earlier test's failure is its own, not this one's
        fleet.stack.wait_worker(fleet.spawn_worker())
    workers = fleet.workers()
    gone_before = [child for child in fleet.stack.children if not child.alive()]
    fleet.pause(workers)
    # Resolved before any job runs: each kill must land while the poison generates, and on
    # its last chance it runs alone and a fast machine finishes it within a second. (CI,
    # 2026-12-06: polling the stream, then the job record, then every worker's announcement
    # and process tree, the second kill came a second after the poison had succeeded.)
    cores = {fleet.worker_id(worker): (worker, engine_core(worker)) for worker in workers}
    try:
        # All four streamed: their text shows when they generate (the stream is written by
        # a job in the engine only).
        streams = [StreamingCompletion(fleet) for _ in range(4)]
        for stream in streams:
            stream.start()
        poison_id, *mates = [stream.started() for stream in streams]
        fleet.resume(workers[:1])
        fleet.wait_all_running([poison_id, *mates])
    finally:
        fleet.resume(workers[1:])
    # The first kill comes once all four generate together: three mates die with the poison.
    for mate in mates:
        _next_execution(fleet, mate, [])
    killed: list[Child] = []
    executions: list[str] = []
    for _ in range(MAX_ATTEMPTS):
        execution = _next_execution(fleet, poison_id, executions)  # it generates: kill it
        worker_id = execution.rpartition("|")[0]
        if worker_id not in cores:  # a replacement, up already
            host = fleet.worker_announced_as(worker_id)
            cores[worker_id] = (host, engine_core(host))
        host, core = cores[worker_id]
        core.send_signal(signal.SIGKILL)
        killed.append(host)
        executions.append(execution)
        fleet.spawn_worker()  # its orchestrator restarts it
        now = fleet.job(poison_id)
        assert now.status != "succeeded", (
            f"execution {execution} of the poison finished before its engine was killed: "
            "the test lost its race, not the product",
            now.model_dump_json(),
        )
    for host in killed:
        assert host.process.wait(timeout=EXIT_BOUND_S) == EXIT_ENGINE_FAILED

    job = fleet.wait_finished(poison_id, timeout_s=300)
    assert job.status == "failed", job.model_dump_json()
    assert job.error is not None and job.error.code == "attempts_exhausted"
    assert job.engine_failures == MAX_ATTEMPTS
    assert "engine" in job.error.message
    poison, *mate_streams = streams
    poison.join(60)
    assert poison.done and poison.error is not None
    assert poison.error["code"] == "attempts_exhausted"
    for job_id, stream in zip(mates, mate_streams, strict=True):
        mate = fleet.wait_finished(job_id, timeout_s=300)
        assert mate.status == "succeeded", mate.model_dump_json()
        assert 1 <= mate.engine_failures < MAX_ATTEMPTS
        # Its caller's stream went on across the redelivery: every character once.
        stream.join(60)
        assert (stream.done, stream.error) == (True, None)
        assert mate.result is not None and stream.text == mate.result.text
    assert fleet.admitted() == {"tier": 0, "tenant": 0}
    for worker in fleet.workers():
        fleet.stack.wait_worker(worker)
    # Only the killed hosts left (each replaced): any other worker that exited is named with
    # its log.
    assert len(fleet.workers()) == len(workers), _exited_unkilled(fleet, gone_before + killed)
