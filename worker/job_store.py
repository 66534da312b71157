"""Job records in Redis, worker side: claim a delivery, finish it, or give it back.

Every write is one call of ``contracts.job_records.ADVANCE`` (compare-and-set).
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from dataclasses import dataclass
from datetime import UTC, datetime
from enum import StrEnum
from typing import TypeVar

from redis import Redis
from redis.exceptions import ConnectionError, TimeoutError

from contracts.errors import ErrorBody, ErrorCode
from contracts.job_records import ADVANCE, Advance, advance_call
from contracts.jobs import JobPublic, JobResult, JobStatus, ResultMetadata
from contracts.keys import job_key

log = logging.getLogger(__name__)
T = TypeVar("T")


class ClaimOutcome(StrEnum):
    RUN = "run"  # this delivery runs the job (attempt counted)
    FINISHED = "finished"  # terminal already: a duplicate delivery, or cancelled while queued
    MISSING = "missing"  # no record: expired, or withdrawn by a gateway whose enqueue failed
    EXHAUSTED = "exhausted"  # too many attempts started before: failed with attempts_exhausted


@dataclass(frozen=True)
class Claim:
    outcome: ClaimOutcome
    job: JobPublic | None


class JobStore:
    """Reads and advances job records.

    Redis restarting must not lose an outcome: reads and writes are retried with backoff for
    up to ``outage_s`` before the error propagates (and the job is left to redelivery).
    """

    def __init__(self, redis: Redis, ttl_s: int, outage_s: float = 60.0) -> None:
        self._redis = redis
        self._ttl_s = ttl_s
        self._outage_s = outage_s
        self._advance = redis.register_script(ADVANCE)

    def _patiently(self, call: Callable[[], T]) -> T:
        deadline = time.monotonic() + self._outage_s
        delay = 0.1
        while True:
            try:
                return call()
            except (ConnectionError, TimeoutError) as exc:
                if time.monotonic() + delay > deadline:
                    raise
                log.warning("Redis unavailable (%s); retrying in %.1f s", exc, delay)
                time.sleep(delay)
                delay = min(delay * 2, 2.0)

    def get(self, job_id: str) -> JobPublic | None:
        raw = self._patiently(lambda: self._redis.hget(job_key(job_id), "record"))
        if raw is None:
            return None
        return JobPublic.model_validate_json(raw)

    def statuses(self, job_ids: list[str]) -> dict[str, str | None]:
        """Current status of each job (``None``: no record), in one round trip."""
        pipe = self._redis.pipeline(transaction=False)
        for job_id in job_ids:
            pipe.hget(job_key(job_id), "status")
        return dict(zip(job_ids, pipe.execute(), strict=True))

    def _write(self, job: JobPublic, expect_attempts: int | None = None) -> Advance:
        keys, args = advance_call(job, self._ttl_s, expect_attempts)
        return Advance(int(self._patiently(lambda: self._advance(keys=keys, args=args))))

    def claim(self, job_id: str, worker_id: str, max_attempts: int) -> Claim:
        """Start an attempt: ``running`` with the attempt counted, unless it must not run.

        The attempt is counted before anything runs, so a job that kills its worker every
        time is stopped by the counter even though no attempt ever finishes.
        """
        while True:
            job = self.get(job_id)
            if job is None:
                return Claim(ClaimOutcome.MISSING, None)
            if job.status.terminal:
                return Claim(ClaimOutcome.FINISHED, job)
            if job.attempts >= max_attempts:
                wanted = ClaimOutcome.EXHAUSTED
                claimed = _finished(
                    job,
                    JobStatus.FAILED,
                    error=ErrorBody(
                        code=ErrorCode.ATTEMPTS_EXHAUSTED,
                        message=f"The job was started {job.attempts} times and no attempt "
                        "finished (its worker died or was stopped each time); it will not be "
                        "tried again.",
                    ),
                )
            else:
                wanted = ClaimOutcome.RUN
                claimed = job.model_copy(
                    update={
                        "status": JobStatus.RUNNING,
                        "started_at": _now(),
                        "attempts": job.attempts + 1,
                        "worker": worker_id,
                    }
                )
            outcome = self._write(claimed, expect_attempts=job.attempts)
            if outcome == Advance.WRITTEN:
                return Claim(wanted, claimed)
            if outcome == Advance.MISSING:
                return Claim(ClaimOutcome.MISSING, None)
            # CONFLICT or ALREADY_FINISHED: someone wrote in between; decide again.

    def release(self, job: JobPublic) -> bool:
        """Give a running attempt back (worker draining): ``queued``, the attempt uncounted.

        Only if no other write happened since ``job`` was claimed.
        """
        queued = job.model_copy(
            update={"status": JobStatus.QUEUED, "attempts": job.attempts - 1, "started_at": None}
        )
        return self._write(queued, expect_attempts=job.attempts) == Advance.WRITTEN

    def succeed(self, job: JobPublic, result: JobResult, metadata: ResultMetadata) -> bool:
        done = _finished(job, JobStatus.SUCCEEDED, result=result, metadata=metadata)
        return self._write(done) == Advance.WRITTEN

    def fail(self, job: JobPublic, error: ErrorBody, metadata: ResultMetadata | None) -> bool:
        done = _finished(job, JobStatus.FAILED, error=error, metadata=metadata)
        return self._write(done) == Advance.WRITTEN


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
