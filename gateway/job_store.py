"""Job records in Redis, gateway side: create on admission, read for status, cancel."""

from __future__ import annotations

from datetime import UTC, datetime

from redis.asyncio import Redis

from contracts.errors import ErrorBody, ErrorCode
from contracts.job_records import ADVANCE, Advance, advance_call
from contracts.jobs import JobPublic, JobStatus
from contracts.keys import job_key


async def create_job(redis: Redis, job: JobPublic, ttl_s: int) -> None:
    """Store a new job record; the worker only ever advances it from here."""
    key = job_key(job.id)
    async with redis.pipeline(transaction=True) as pipe:
        pipe.hset(
            key,
            mapping={"status": job.status.value, "record": job.model_dump_json(), "attempts": 0},
        )
        pipe.expire(key, ttl_s)
        await pipe.execute()


async def delete_job(redis: Redis, job_id: str) -> None:
    """Remove a record whose enqueue failed, so no trace of a refused job remains."""
    await redis.delete(job_key(job_id))


async def get_job(redis: Redis, job_id: str) -> JobPublic | None:
    raw = await redis.hget(job_key(job_id), "record")
    if raw is None:
        return None
    return JobPublic.model_validate_json(raw)


async def cancel_job(redis: Redis, job_id: str, ttl_s: int) -> JobPublic | None:
    """Move a queued or running job to ``cancelled``; the job as it is afterwards.

    The write is a compare-and-set on the attempts counter: if a worker claimed the job
    between our read and our write, read again and retry. A worker that later receives the
    job skips it; one running it hears the cancellation and aborts the engine request.
    Returns ``None`` if there is no such job; a finished job is returned unchanged.
    """
    advance = redis.register_script(ADVANCE)
    while True:
        job = await get_job(redis, job_id)
        if job is None or job.status.terminal:
            return job
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
            return cancelled
        if outcome == Advance.MISSING:
            return None
