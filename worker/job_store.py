"""Job records in Redis, worker side: claim a delivery, finish it, or give it back.

A claim is ``contracts.job_records.CLAIM`` (it counts the attempt itself, refused while
another attempt holds the job's lease); every other write is one call of ``ADVANCE``. An
outcome is written only if ``attempts`` still holds this attempt's number, so an attempt that
another one superseded (after a long Redis outage, say) cannot overwrite anything.
"""

from __future__ import annotations

import functools
import logging
import time
from collections.abc import Callable
from dataclasses import dataclass
from datetime import UTC, datetime
from enum import StrEnum
from typing import Any, TypeVar

from redis import Redis
from redis.commands.core import Script
from redis.exceptions import ConnectionError, TimeoutError

from contracts.errors import ErrorBody, ErrorCode
from contracts.job_records import (
    ADVANCE,
    CLAIM,
    RECORD_FIELDS,
    Advance,
    Claimed,
    advance_call,
    claim_call,
    job_of,
)
from contracts.jobs import JobPublic, JobResult, JobStatus, ResultMetadata
from contracts.keys import job_key
from worker.script_batch import ScriptBatch

log = logging.getLogger(__name__)
T = TypeVar("T")


class ClaimOutcome(StrEnum):
    RUN = "run"  # this delivery runs the job (attempt counted)
    FINISHED = "finished"  # terminal already: a duplicate delivery, or cancelled while queued
    MISSING = "missing"  # no record: expired, or withdrawn by a gateway whose enqueue failed
    EXHAUSTED = "exhausted"  # too many attempts started before: failed with attempts_exhausted
    ELSEWHERE = "elsewhere"  # another attempt held the lease until past the job's deadline
    ABANDONED = "abandoned"  # this worker stopped waiting for the lease (it is failing)


LEASE_POLL_S = 0.5
"""How often a delivery waiting for another attempt's lease looks again."""


@dataclass(frozen=True)
class Claim:
    outcome: ClaimOutcome
    job: JobPublic | None


class JobStore:
    """Reads and advances job records.

    Redis restarting must not lose an outcome: reads and writes are retried with backoff for
    up to ``outage_s`` before the error propagates (and the job is left to redelivery).
    With a ``batch``, the scripts go to Redis with other threads' (``worker.script_batch``).
    """

    def __init__(
        self,
        redis: Redis,
        ttl_s: int,
        worker_id: str = "",
        lease_ttl_s: float = 60.0,
        outage_s: float = 60.0,
        batch: ScriptBatch | None = None,
    ) -> None:
        self._redis = redis
        self._batch = batch
        self._ttl_s = ttl_s
        self._worker_id = worker_id
        self._lease_ttl_s = lease_ttl_s
        self._outage_s = outage_s
        self._advance = redis.register_script(ADVANCE)
        self._claim = redis.register_script(CLAIM)
        self._last_outage = -float("inf")

    def note_outage(self) -> None:
        """Redis was unreachable just now (from any of this process's clients)."""
        self._last_outage = time.monotonic()

    def outage_within(self, seconds: float) -> bool:
        """Redis was seen unreachable in the last ``seconds``."""
        return time.monotonic() - self._last_outage < seconds

    def _patiently(self, call: Callable[[], T]) -> T:
        deadline = time.monotonic() + self._outage_s
        delay = 0.1
        while True:
            try:
                return call()
            except (ConnectionError, TimeoutError) as exc:
                self.note_outage()
                if time.monotonic() + delay > deadline:
                    raise
                log.warning("Redis unavailable (%s); retrying in %.1f s", exc, delay)
                time.sleep(delay)
                delay = min(delay * 2, 2.0)

    def _run(self, script: Script, keys: list[str], args: list[str | int]) -> Any:
        if self._batch is None:
            return script(keys=keys, args=args)
        return self._batch.call(script, keys, args)

    def get(self, job_id: str) -> JobPublic | None:
        return job_of(self._patiently(lambda: self._redis.hmget(job_key(job_id), RECORD_FIELDS)))

    def statuses(self, job_ids: list[str]) -> dict[str, str | None]:
        """Current status of each job (``None``: no record), in one round trip."""
        pipe = self._redis.pipeline(transaction=False)
        for job_id in job_ids:
            pipe.hget(job_key(job_id), "status")
        return dict(zip(job_ids, pipe.execute(), strict=True))

    def _write(self, job: JobPublic, expect_attempts: int | None = None) -> Advance:
        keys, args = advance_call(job, self._ttl_s, expect_attempts)
        return Advance(
            int(self._patiently(functools.partial(self._run, self._advance, keys, args)))
        )

    def claim(
        self,
        job_id: str,
        max_attempts: int,
        wait_until: float,
        abandon: Callable[[], bool],
        rejoin_s: float,
        delivery: str = "",
        routed_to: str | None = None,
    ) -> Claim:
        """Start an attempt: ``running`` with the attempt counted and the lease taken, unless
        the job must not run here. One round trip when it runs (``CLAIM``).

        The attempt is counted before anything runs, so a job that kills its worker every
        time is stopped by the counter even though no attempt ever finishes. While another
        attempt holds the job's lease this delivery waits (it is a duplicate: a reaper or a
        reconnect handed the message back while that attempt lived) until the lease ends,
        ``wait_until`` (unix time) passes, or ``abandon()`` says to stop. Right after a Redis
        outage (within ``rejoin_s``), a running job without a lease is given that long for its
        attempt to take its lease back before it is claimed again. ``delivery`` (the message's
        broker tag) is recorded as held by this worker in the same step; ``routed_to`` (the
        worker the job was routed to) has its kept message released (``routed_key``).
        """
        while True:
            started = _now()
            keys, args = claim_call(
                job_id,
                self._worker_id,
                started,
                max_attempts,
                self.outage_within(rejoin_s),
                self._lease_ttl_s,
                self._ttl_s,
                delivery,
                routed_to,
            )
            reply = self._patiently(functools.partial(self._run, self._claim, keys, args))
            outcome = Claimed(reply[0])
            job = job_of(reply[1:]) if outcome != Claimed.MISSING else None
            if job is None:
                return Claim(ClaimOutcome.MISSING, None)
            if outcome == Claimed.FINISHED:
                return Claim(ClaimOutcome.FINISHED, job)
            if outcome == Claimed.RUN:
                return Claim(ClaimOutcome.RUN, job)
            if outcome == Claimed.EXHAUSTED:
                exhausted = _exhausted(job, max_attempts)
                assert exhausted is not None
                written = self._write(exhausted, expect_attempts=job.attempts)
                if written == Advance.WRITTEN:
                    return Claim(ClaimOutcome.EXHAUSTED, exhausted)
                continue  # someone wrote in between: decide again
            # LEASED or REJOINING: another attempt runs it, or may take it back.
            if abandon():
                return Claim(ClaimOutcome.ABANDONED, job)
            if time.time() >= wait_until:
                return Claim(ClaimOutcome.ELSEWHERE, job)
            time.sleep(LEASE_POLL_S)

    def release(self, job: JobPublic) -> bool:
        """Give a running attempt back (worker draining): ``queued``, the attempt uncounted,
        the lease dropped. Only if no other write happened since ``job`` was claimed."""
        queued = job.model_copy(
            update={"status": JobStatus.QUEUED, "attempts": job.attempts - 1, "started_at": None}
        )
        return self._write(queued, expect_attempts=job.attempts) == Advance.WRITTEN

    def survive_engine(
        self, job: JobPublic, under_it: bool, max_attempts: int
    ) -> ClaimOutcome | None:
        """The engine running ``job`` failed: give the attempt back uncounted (``RUN``: it may
        run elsewhere), or, if it was generating under the engine (``under_it``) as many times
        as it may, end it ``attempts_exhausted`` (``EXHAUSTED``). ``None``: someone wrote
        since the claim (a cancellation, say), and that stands."""
        engine_failures = job.engine_failures + int(under_it)
        queued = job.model_copy(
            update={
                "status": JobStatus.QUEUED,
                "attempts": job.attempts - 1,
                "started_at": None,
                "engine_failures": engine_failures,
            }
        )
        exhausted = _exhausted(queued, max_attempts)
        outcome = ClaimOutcome.RUN if exhausted is None else ClaimOutcome.EXHAUSTED
        written = self._write(exhausted or queued, expect_attempts=job.attempts)
        return outcome if written == Advance.WRITTEN else None

    def succeed(self, job: JobPublic, result: JobResult | None, metadata: ResultMetadata) -> bool:
        """Store the result of attempt ``job.attempts``, if it is still the current one
        (``None``: it is in the object store, and ``metadata.result_stored`` says where)."""
        done = _finished(job, JobStatus.SUCCEEDED, result=result, metadata=metadata)
        return self._write(done, expect_attempts=job.attempts) == Advance.WRITTEN

    def fail(self, job: JobPublic, error: ErrorBody, metadata: ResultMetadata | None) -> bool:
        """Store the failure of attempt ``job.attempts``, if it is still the current one."""
        done = _finished(job, JobStatus.FAILED, error=error, metadata=metadata)
        return self._write(done, expect_attempts=job.attempts) == Advance.WRITTEN

    def expire(self, job: JobPublic) -> bool:
        """Fail ``job`` ``deadline_exceeded`` as it is now (the deadline sweeper), saying where
        it was last seen; only if nothing else wrote to it since it was read."""
        if job.status == JobStatus.RUNNING:
            where = f"was running on worker {job.worker} (attempt {job.attempts})"
        elif job.attempts:
            where = f"waited in the queue ({job.queue}) again after {job.attempts} attempt(s)"
        else:
            # The phrase the worker uses when it meets such a job first: whoever ends it, the
            # message says the same thing.
            where = f"waited in the queue ({job.queue}) and never started"
        deadline = job.deadline_at.isoformat() if job.deadline_at else "its deadline"
        error = ErrorBody(
            code=ErrorCode.DEADLINE_EXCEEDED,
            message=f"The job's deadline ({deadline}) passed while it {where}; no worker "
            "finished it, so the deadline sweeper ended it.",
        )
        done = _finished(job, JobStatus.FAILED, error=error, metadata=job.metadata)
        return self._write(done, expect_attempts=job.attempts) == Advance.WRITTEN


def _exhausted(job: JobPublic, max_attempts: int) -> JobPublic | None:
    """The job failed ``attempts_exhausted``, if it may not start again."""
    if job.attempts >= max_attempts:
        why = (
            f"The job was started {job.attempts} times and no attempt finished (its worker "
            "died or was stopped each time); it will not be tried again."
        )
    elif job.engine_failures >= max_attempts:
        why = (
            f"The engine running the job died {job.engine_failures} times while the job was "
            "generating (each time on a worker that then restarted); it will not be tried "
            "again."
        )
    else:
        return None
    error = ErrorBody(code=ErrorCode.ATTEMPTS_EXHAUSTED, message=why)
    return _finished(job, JobStatus.FAILED, error=error)


def _finished(
    job: JobPublic,
    status: JobStatus,
    *,
    result: JobResult | None = None,
    error: ErrorBody | None = None,
    metadata: ResultMetadata | None = None,
) -> JobPublic:
    return job.model_copy(
        update={
            "status": status,
            "finished_at": _now(),
            "result": result,
            "error": error,
            "metadata": metadata,
        }
    )


def _now() -> datetime:
    return datetime.now(tz=UTC)
