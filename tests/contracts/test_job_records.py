"""The job-record compare-and-set script, run by a real Redis (the session's Valkey)."""

from __future__ import annotations

import time
import uuid
from typing import Any

from redis import Redis

from contracts import admission
from contracts.errors import ErrorBody, ErrorCode
from contracts.job_records import (
    ADVANCE,
    REPLY_MAX_BYTES,
    Advance,
    advance_call,
    reply_id,
    reply_job,
)
from contracts.jobs import JobPublic, JobStatus
from contracts.keys import JOB_CANCELS, JOB_EVENTS, job_key, reply_channel
from tests.contracts.test_admission import LIMITS
from tests.helpers import new_job


def _job(status: JobStatus = JobStatus.QUEUED, attempts: int = 0) -> JobPublic:
    return new_job(status=status, attempts=attempts)


def _create(redis: Redis, job: JobPublic) -> None:
    redis.hset(
        job_key(job.id),
        mapping={"status": job.status.value, "record": job.model_dump_json(), "attempts": 0},
    )


def _advance(redis: Redis, job: JobPublic, expect: int | None = None) -> Advance:
    keys, args = advance_call(job, 60, expect)
    return Advance(int(redis.register_script(ADVANCE)(keys=keys, args=args)))


def test_terminal_states_are_final_and_published_once(redis: Redis) -> None:
    job = _job()
    _create(redis, job)
    events = redis.pubsub(ignore_subscribe_messages=True)
    events.subscribe(JOB_EVENTS)
    running = job.model_copy(update={"status": JobStatus.RUNNING, "attempts": 1})
    assert _advance(redis, running, expect=0) == Advance.WRITTEN
    done = running.model_copy(update={"status": JobStatus.SUCCEEDED})
    assert _advance(redis, done) == Advance.WRITTEN
    for late in (JobStatus.FAILED, JobStatus.RUNNING, JobStatus.CANCELLED):
        assert _advance(redis, done.model_copy(update={"status": late})) == (
            Advance.ALREADY_FINISHED
        )
    # The same write sent again (its reply was lost): it was written, once.
    assert _advance(redis, done) == Advance.WRITTEN
    other = done.model_copy(update={"error": None, "worker": "someone-else"})
    assert _advance(redis, other) == Advance.ALREADY_FINISHED
    assert redis.hget(job_key(job.id), "status") == "succeeded"
    assert redis.hget(job_key(job.id), "attempts") == "1"
    published = []
    for _ in range(20):  # 2 s of listening, well past the writes above
        message = events.get_message(timeout=0.1)
        if message is not None and message["type"] == "message":
            published.append(message["data"])
    # Other tests' jobs (the session stack's worker) may end meanwhile: only this one counts.
    assert [item for item in published if item == job.id] == [job.id]


def test_a_stale_writer_loses_the_compare_and_set(redis: Redis) -> None:
    job = _job()
    _create(redis, job)
    claimed = job.model_copy(update={"status": JobStatus.RUNNING, "attempts": 1})
    assert _advance(redis, claimed, expect=0) == Advance.WRITTEN
    # A canceller that read the job before the claim (attempts 0) must re-read.
    cancelled = job.model_copy(update={"status": JobStatus.CANCELLED})
    assert _advance(redis, cancelled, expect=0) == Advance.CONFLICT
    assert redis.hget(job_key(job.id), "status") == "running"


def test_cancellation_is_announced_to_workers(redis: Redis) -> None:
    job = _job()
    _create(redis, job)
    cancels = redis.pubsub(ignore_subscribe_messages=True)
    cancels.subscribe(JOB_CANCELS)
    cancels.get_message(timeout=0.5)  # the subscription confirmation
    assert _advance(redis, job.model_copy(update={"status": JobStatus.CANCELLED})) == (
        Advance.WRITTEN
    )
    message = cancels.get_message(timeout=2)
    assert message is not None and message["data"] == job.id


def test_a_missing_record_is_never_created(redis: Redis) -> None:
    job = _job()
    assert _advance(redis, job.model_copy(update={"status": JobStatus.FAILED})) == Advance.MISSING
    assert not redis.exists(job_key(job.id))


def test_a_write_sent_again_after_its_reply_was_lost_is_answered_written(redis: Redis) -> None:
    """A worker gives an attempt back (``queued``, the attempt uncounted, only if the counter
    still says its attempt); the reply is lost and the write is sent again as it was. The
    counter no longer says that attempt, but the write is its own: written, not a conflict
    (which would make the worker drop a job it had handed back)."""
    job = _job()
    _create(redis, job)
    running = job.model_copy(update={"status": JobStatus.RUNNING, "attempts": 1})
    assert _advance(redis, running, expect=0) == Advance.WRITTEN
    back = running.model_copy(update={"status": JobStatus.QUEUED, "attempts": 0})
    assert _advance(redis, back, expect=1) == Advance.WRITTEN
    assert _advance(redis, back, expect=1) == Advance.WRITTEN
    other = back.model_copy(update={"worker": "someone-else"})
    assert _advance(redis, other, expect=1) == Advance.CONFLICT
    assert redis.hget(job_key(job.id), "attempts") == "0"


def _listen(redis: Redis) -> Any:
    """A subscription to ``JOB_EVENTS`` and to every gateway's reply channel, confirmed."""
    pubsub = redis.pubsub()
    pubsub.subscribe(JOB_EVENTS)
    pubsub.psubscribe(reply_channel("*"))
    for _ in range(2):
        message = pubsub.get_message(timeout=5)
        assert message is not None and message["type"] in ("subscribe", "psubscribe")
    return pubsub


def _published(pubsub: Any, job_id: str) -> list[tuple[str, str]]:
    """``(channel, data)`` of what came for ``job_id`` within a second, in order (other tests'
    jobs may end meanwhile on the session's stack)."""
    came = []
    deadline = time.monotonic() + 1.0
    while time.monotonic() < deadline:
        message = pubsub.get_message(timeout=0.1)
        if message is None or message["type"] not in ("message", "pmessage"):
            continue
        if reply_id(message["data"]) == job_id:
            came.append((message["channel"], message["data"]))
    return came


def _admit(redis: Redis, job: JobPublic, reply_to: str | None) -> None:
    # A deadline far off: the session stack's sweeper fails a job past it.
    keys, args = admission.admit_call(job, time.time() + 3600, LIMITS, 600, reply_to=reply_to)
    reply = redis.register_script(admission.ADMIT)(keys=keys, args=args)
    assert admission.verdict(reply).refusal is None


def test_the_final_record_goes_to_the_reply_channel_the_admission_named(redis: Redis) -> None:
    """A job admitted for a caller who waits on one gateway: its terminal write publishes the
    record there (which that gateway parses instead of reading the hash back), before the id
    goes out to every gateway; earlier writes publish nothing."""
    job = new_job(tenant=uuid.uuid4().hex)
    replies = reply_channel("gw-" + job.id)
    _admit(redis, job, replies)
    assert redis.hget(job_key(job.id), "reply") == replies
    pubsub = _listen(redis)
    running = job.model_copy(update={"status": JobStatus.RUNNING, "attempts": 1})
    assert _advance(redis, running, expect=0) == Advance.WRITTEN
    assert _published(pubsub, job.id) == []
    done = running.model_copy(update={"status": JobStatus.SUCCEEDED, "worker": "w"})
    assert _advance(redis, done) == Advance.WRITTEN
    assert _advance(redis, done) == Advance.WRITTEN  # its reply lost, sent again: no effect
    came = _published(pubsub, job.id)
    assert [channel for channel, _ in came] == [replies, JOB_EVENTS]
    assert reply_job(came[0][1]) == done
    assert came[1][1] == job.id


def _failed(job: JobPublic, record_bytes: int) -> JobPublic:
    """``job`` failed, with an error message that makes its record ``record_bytes`` long."""
    error = ErrorBody(code=ErrorCode.INTERNAL_ERROR, message="")
    failed = job.model_copy(update={"status": JobStatus.FAILED, "error": error})
    padding = "x" * (record_bytes - len(failed.model_dump_json()))
    failed = failed.model_copy(update={"error": error.model_copy(update={"message": padding})})
    assert len(failed.model_dump_json()) == record_bytes
    return failed


def test_a_record_past_the_bound_and_a_job_without_a_reply_channel_are_only_announced(
    redis: Redis,
) -> None:
    """Up to ``REPLY_MAX_BYTES`` the record is published on the reply channel; one byte more
    and it stays in Redis: no reply channel hears of it, and its gateway reads the record
    when the id comes on ``JOB_EVENTS``. A job admitted without a reply channel (streamed,
    jobs API) publishes only its id."""
    at_bound, past, plain = (new_job(tenant=uuid.uuid4().hex) for _ in range(3))
    replies = reply_channel("gw-" + at_bound.id)
    for job, reply_to in ((at_bound, replies), (past, replies), (plain, None)):
        _admit(redis, job, reply_to)
    assert redis.hget(job_key(plain.id), "reply") is None
    pubsub = _listen(redis)
    assert _advance(redis, _failed(at_bound, REPLY_MAX_BYTES)) == Advance.WRITTEN
    assert [channel for channel, _ in _published(pubsub, at_bound.id)] == [replies, JOB_EVENTS]
    for job in (past, plain):
        assert _advance(redis, _failed(job, REPLY_MAX_BYTES + 1)) == Advance.WRITTEN
        assert _published(pubsub, job.id) == [(JOB_EVENTS, job.id)]
