"""Job records in Redis, gateway side: read for status, cancel. (Admission writes them:
``gateway.submit``.) A tenant only ever sees its own jobs: another tenant's job reads as
missing, through the same single read."""

from __future__ import annotations

from datetime import UTC, datetime

from redis.asyncio import Redis

from contracts.errors import ErrorBody, ErrorCode
from contracts.job_records import ADVANCE, RECORD_FIELDS, Advance, advance_call, job_of
from contracts.jobs import JobPublic, JobStatus
from contracts.keys import job_key


async def get_job(redis: Redis, job_id: str, tenant: str) -> JobPublic | None:
    job = job_of(await redis.hmget(job_key(job_id), RECORD_FIELDS))
    return job if job is not None and job.tenant == tenant else None


async def cancel_job(
    redis: Redis, job_id: str, tenant: str, ttl_s: int, only_queued: bool = False
) -> tuple[JobPublic | None, bool]:
    """Move a queued or running job to ``cancelled``; the job as it is afterwards.

    The write is a compare-and-set on the attempts counter: if a worker claimed the job
    between our read and our write, read again and retry. A worker that later receives the
    job skips it; one running it hears the cancellation and aborts the engine request.
    Returns the job (``None`` if there is no such job; a finished one unchanged) and whether
    this call cancelled it.
    """
    advance = redis.register_script(ADVANCE)
    while True:
        job = await get_job(redis, job_id, tenant)
        if job is None or job.status.terminal:
            return job, False
        if only_queued and job.status != JobStatus.QUEUED:
            return job, False
        cancelled = job.model_copy(
            update={
                "status": JobStatus.CANCELLED,
                "finished_at": datetime.now(tz=UTC),
                "error": ErrorBody(
                    code=ErrorCode.CANCELLED,
                    message=f"The job was cancelled by the caller while {job.status.value}.",
                ),
            }
        )
        keys, args = advance_call(cancelled, ttl_s, expect_attempts=job.attempts)
        outcome = Advance(int(await advance(keys=keys, args=args)))
        if outcome == Advance.WRITTEN:
            return cancelled, True
        if outcome == Advance.MISSING:
            return None, False
