"""Job records in Redis, gateway side: create on admission, read for status."""

from __future__ import annotations

from redis.asyncio import Redis

from contracts.jobs import JobPublic
from contracts.keys import job_key


async def create_job(redis: Redis, job: JobPublic, ttl_s: int) -> None:
    """Store a new job record; the worker only ever advances it from here."""
    key = job_key(job.id)
    async with redis.pipeline(transaction=True) as pipe:
        pipe.hset(key, mapping={"status": job.status.value, "record": job.model_dump_json()})
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
