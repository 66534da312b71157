"""The lease scripts (claim, renew, fenced stream appends), run by a real Redis."""

from __future__ import annotations

from datetime import UTC, datetime

from redis import Redis

from contracts.job_records import (
    ADVANCE,
    APPEND_DELTAS,
    CLAIM,
    RENEW,
    Advance,
    Claimed,
    advance_call,
    append_call,
    claim_call,
    lease_value,
    renew_call,
)
from contracts.jobs import JobPublic, JobStatus
from contracts.keys import DEADLINES, STREAM_END, job_key, lease_key, stream_key
from tests.helpers import job_record, new_job

TTL_S = 60.0


def _queued(redis: Redis) -> JobPublic:
    job = new_job()
    redis.hset(
        job_key(job.id),
        mapping={"status": "queued", "record": job.model_dump_json(), "attempts": 0},
    )
    redis.zadd(DEADLINES, {job.id: 1.0})
    return job


def _claim(
    redis: Redis, job: JobPublic, worker: str, max_attempts: int = 3, rejoining: bool = False
) -> tuple[Claimed, JobPublic]:
    """The claim's outcome, and the job as its hash now shows it."""
    keys, args = claim_call(
        job.id, worker, datetime.now(tz=UTC), max_attempts, rejoining, TTL_S, 60
    )
    outcome = Claimed(redis.register_script(CLAIM)(keys=keys, args=args)[0])
    return outcome, job_record(redis, job.id)


def _renew(redis: Redis, job: JobPublic, worker: str) -> bool:
    keys, args = renew_call([(job.id, lease_value(worker, job.attempts))], TTL_S)
    return not redis.register_script(RENEW)(keys=keys, args=args)


def _append(redis: Redis, job: JobPublic, worker: str, text: str, offset: int = 0) -> bool:
    lease = lease_value(worker, job.attempts)
    keys, args = append_call([(job.id, lease, offset, text)], 60, TTL_S)
    return not redis.register_script(APPEND_DELTAS)(keys=keys, args=args)


def test_a_second_delivery_cannot_claim_while_the_first_attempt_holds_the_lease(
    redis: Redis,
) -> None:
    job = _queued(redis)
    outcome, running = _claim(redis, job, "w1:1:a")
    assert outcome == Claimed.RUN
    assert redis.get(lease_key(job.id)) == "w1:1:a|1"
    # The same record, read by another worker: refused while the lease is held.
    assert _claim(redis, job, "w2:2:b")[0] == Claimed.LEASED
    assert redis.hget(job_key(job.id), "attempts") == "1"
    assert _renew(redis, running, "w1:1:a")


def test_a_claim_sent_again_after_its_reply_was_lost_answers_run_once_counted(
    redis: Redis,
) -> None:
    """A worker's claim timed out and is sent again as it was: it had run, so the resend
    answers ``run`` (not ``leased`` by the worker's own lease, which would leave the job to
    wait out that lease and spend an attempt), and counts no second attempt. Another claim,
    even by the same worker, is refused while the lease is held."""
    job = _queued(redis)
    keys, args = claim_call(job.id, "w1:1:a", datetime.now(tz=UTC), 3, False, TTL_S, 60)
    claim = redis.register_script(CLAIM)
    assert claim(keys=keys, args=args)[0] == Claimed.RUN
    assert claim(keys=keys, args=args)[0] == Claimed.RUN
    assert redis.hget(job_key(job.id), "attempts") == "1"
    assert _claim(redis, job, "w1:1:a")[0] == Claimed.LEASED  # a new delivery of it
    assert _claim(redis, job, "w2:2:b")[0] == Claimed.LEASED


def test_a_lease_lost_to_an_outage_is_taken_back_by_its_attempt_unless_claimed(
    redis: Redis,
) -> None:
    job = _queued(redis)
    _, running = _claim(redis, job, "w1:1:a")
    redis.delete(lease_key(job.id))  # expired while Redis was down
    assert _append(redis, running, "w1:1:a", "Hel")  # taken back, text appended
    assert redis.get(lease_key(job.id)) == "w1:1:a|1"
    redis.delete(lease_key(job.id))
    assert _renew(redis, running, "w1:1:a")
    # Now another attempt claims it (the lease expired and nobody took it back in time).
    redis.delete(lease_key(job.id))
    outcome, second = _claim(redis, running, "w2:2:b")
    assert outcome == Claimed.RUN
    assert not _renew(redis, running, "w1:1:a")  # lost: the first attempt must stop
    assert not _append(redis, running, "w1:1:a", "lo")  # and its text is refused
    assert _append(redis, second, "w2:2:b", "Hello")
    entries = redis.xrange(stream_key(job.id))
    assert [(f["attempt"], f["text"]) for _, f in entries] == [  # type: ignore[union-attr]
        ("w1:1:a|1", "Hel"),
        ("w2:2:b|2", "Hello"),  # another execution: from its own start
    ]
    # The first attempt's outcome is refused too: the counter is the second's.
    done = running.model_copy(update={"status": JobStatus.SUCCEEDED})
    keys, args = advance_call(done, 60, expect_attempts=running.attempts)
    assert Advance(int(redis.register_script(ADVANCE)(keys=keys, args=args))) == Advance.CONFLICT


def test_queued_again_or_finished_drops_the_lease_and_the_deadline_entry(redis: Redis) -> None:
    job = _queued(redis)
    _, running = _claim(redis, job, "w1:1:a")
    released = running.model_copy(update={"status": JobStatus.QUEUED, "attempts": 0})
    keys, args = advance_call(released, 60, expect_attempts=1)
    assert Advance(int(redis.register_script(ADVANCE)(keys=keys, args=args))) == Advance.WRITTEN
    assert not redis.exists(lease_key(job.id))
    assert redis.zscore(DEADLINES, job.id) is not None  # still admitted, still due
    outcome, running = _claim(redis, released, "w2:2:b")
    assert outcome == Claimed.RUN and running.attempts == 1
    done = running.model_copy(update={"status": JobStatus.FAILED})
    keys, args = advance_call(done, 60, expect_attempts=1)
    assert Advance(int(redis.register_script(ADVANCE)(keys=keys, args=args))) == Advance.WRITTEN
    assert not redis.exists(lease_key(job.id))
    assert redis.zscore(DEADLINES, job.id) is None
    assert not _renew(redis, running, "w2:2:b")  # a finished job's lease is never taken back


def test_the_terminal_write_ends_the_stream_with_a_marker_and_creates_none(
    redis: Redis,
) -> None:
    """A streaming reader blocked on the stream learns the end from the stream itself, in
    the script that made the job terminal, and the outcome with it (the record as written,
    and the attempts counter): it need not read the record. A job that streamed nothing
    gets no stream (one whose caller streams has one from its admission)."""
    job = _queued(redis)
    _, running = _claim(redis, job, "w1:1:a")
    assert _append(redis, running, "w1:1:a", "Hel") and _append(redis, running, "w1:1:a", "lo", 3)
    done = running.model_copy(update={"status": JobStatus.SUCCEEDED})
    keys, args = advance_call(done, 60, expect_attempts=running.attempts)
    assert Advance(int(redis.register_script(ADVANCE)(keys=keys, args=args))) == Advance.WRITTEN
    entries = [fields for _, fields in redis.xrange(stream_key(job.id))]  # type: ignore[union-attr]
    assert entries[:2] == [
        {"attempt": "w1:1:a|1", "off": off, "text": t} for off, t in (("0", "Hel"), ("3", "lo"))
    ]
    assert entries[2:] == [
        {STREAM_END: "succeeded", "record": done.model_dump_json(), "attempts": "1"}
    ]
    # A later (refused) terminal write appends nothing.
    failed = running.model_copy(update={"status": JobStatus.FAILED})
    keys, args = advance_call(failed, 60)
    assert Advance(int(redis.register_script(ADVANCE)(keys=keys, args=args))) == (
        Advance.ALREADY_FINISHED
    )
    assert redis.xlen(stream_key(job.id)) == 3

    silent = _queued(redis)
    cancelled = silent.model_copy(update={"status": JobStatus.CANCELLED})
    keys, args = advance_call(cancelled, 60)
    assert Advance(int(redis.register_script(ADVANCE)(keys=keys, args=args))) == Advance.WRITTEN
    assert not redis.exists(stream_key(silent.id))


def test_a_claim_writes_beside_the_record_and_the_next_write_takes_it_in(redis: Redis) -> None:
    """A claim writes the status, count and claim beside the record, not the record itself;
    readers see the running job; the next write of the record replaces them."""
    job = _queued(redis)
    outcome, running = _claim(redis, job, "w1:1:a")
    assert outcome == Claimed.RUN
    assert (running.status, running.attempts, running.worker) == (JobStatus.RUNNING, 1, "w1:1:a")
    assert running.started_at is not None
    assert redis.hget(job_key(job.id), "record") == job.model_dump_json()  # untouched
    done = running.model_copy(update={"status": JobStatus.SUCCEEDED})
    keys, args = advance_call(done, 60, expect_attempts=1)
    assert Advance(int(redis.register_script(ADVANCE)(keys=keys, args=args))) == Advance.WRITTEN
    assert redis.hmget(job_key(job.id), "started_at", "worker") == [None, None]
    finished = job_record(redis, job.id)
    assert (finished.status, finished.worker, finished.started_at) == (
        JobStatus.SUCCEEDED,
        "w1:1:a",
        running.started_at,
    )


def test_a_job_started_or_killed_under_as_often_as_it_may_is_not_claimed(redis: Redis) -> None:
    job = _queued(redis)
    for worker in ("w1:1:a", "w2:2:b"):
        assert _claim(redis, job, worker, max_attempts=2)[0] == Claimed.RUN
        redis.delete(lease_key(job.id))  # its worker died; the lease ran out
    assert _claim(redis, job, "w3:3:c", max_attempts=2)[0] == Claimed.EXHAUSTED
    assert redis.hget(job_key(job.id), "attempts") == "2"  # nothing counted or claimed

    killer = new_job(engine_failures=2)
    redis.hset(
        job_key(killer.id),
        mapping={"status": "queued", "record": killer.model_dump_json(), "attempts": 0},
    )
    assert _claim(redis, killer, "w1:1:a", max_attempts=2)[0] == Claimed.EXHAUSTED


def test_a_rejoining_worker_leaves_a_running_job_to_the_attempt_that_may_take_it_back(
    redis: Redis,
) -> None:
    job = _queued(redis)
    assert _claim(redis, job, "w1:1:a")[0] == Claimed.RUN
    redis.delete(lease_key(job.id))  # expired while Redis was away
    assert _claim(redis, job, "w2:2:b", rejoining=True)[0] == Claimed.REJOINING
    assert _claim(redis, job, "w2:2:b")[0] == Claimed.RUN  # past the grace: claimed again
    assert redis.get(lease_key(job.id)) == "w2:2:b|2"


def test_text_sent_again_after_a_lost_reply_is_appended_once(redis: Redis) -> None:
    """The writer could not tell whether a call ran (its reply was lost) and sends the same
    text again, with what was published since: the stream holds each byte once."""
    job = _queued(redis)
    _, running = _claim(redis, job, "w1:1:a")
    assert _append(redis, running, "w1:1:a", "Hé")  # ran; the worker never heard
    assert _append(redis, running, "w1:1:a", "Héllo", 0)  # sent again, with "llo"
    assert _append(redis, running, "w1:1:a", "Héllo", 0)  # and again: nothing new
    assert _append(redis, running, "w1:1:a", " wörld", len("Héllo".encode()))
    texts = [f["text"] for _, f in redis.xrange(stream_key(job.id))]  # type: ignore[union-attr]
    assert "".join(texts) == "Héllo wörld"
    assert texts == ["Hé", "llo", " wörld"]
