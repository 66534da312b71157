"""Job records in Redis, worker side: advance status, never out of a terminal state."""

from __future__ import annotations

from datetime import UTC, datetime

from redis import Redis

from contracts.errors import ErrorBody
from contracts.jobs import JobPublic, JobResult, JobStatus, ResultMetadata
from contracts.keys import JOB_EVENTS, job_key

# Compare-and-set on the status field: a redelivered or late task can never move a job out
# of succeeded/failed, nor resurrect a record that expired or was never created.
_ADVANCE = """
local status = redis.call('HGET', KEYS[1], 'status')
if not status then return -1 end
if status == 'succeeded' or status == 'failed' then return 0 end
redis.call('HSET', KEYS[1], 'status', ARGV[1], 'record', ARGV[2])
redis.call('EXPIRE', KEYS[1], ARGV[3])
if ARGV[1] == 'succeeded' or ARGV[1] == 'failed' then redis.call('PUBLISH', KEYS[2], ARGV[4]) end
return 1
"""


class JobStore:
    """Reads and advances job records; every write is one atomic script call."""

    def __init__(self, redis: Redis, ttl_s: int) -> None:
        self._redis = redis
        self._ttl_s = ttl_s
        self._advance = redis.register_script(_ADVANCE)

    def get(self, job_id: str) -> JobPublic | None:
        raw = self._redis.hget(job_key(job_id), "record")
        if raw is None:
            return None
        return JobPublic.model_validate_json(raw)

    def _write(self, job: JobPublic) -> bool:
        outcome = self._advance(
            keys=[job_key(job.id), JOB_EVENTS],
            args=[job.status.value, job.model_dump_json(), self._ttl_s, job.id],
        )
        return int(outcome) == 1

    def mark_running(self, job: JobPublic) -> JobPublic | None:
        """``running`` with a start time; ``None`` if the job is already finished or unknown."""
        running = job.model_copy(update={"status": JobStatus.RUNNING, "started_at": _now()})
        return running if self._write(running) else None

    def succeed(self, job: JobPublic, result: JobResult, metadata: ResultMetadata) -> bool:
        done = job.model_copy(
            update={
                "status": JobStatus.SUCCEEDED,
                "finished_at": _now(),
                "result": result,
                "metadata": metadata,
            }
        )
        return self._write(done)

    def fail(self, job: JobPublic, error: ErrorBody, metadata: ResultMetadata | None) -> bool:
        done = job.model_copy(
            update={
                "status": JobStatus.FAILED,
                "finished_at": _now(),
                "error": error,
                "metadata": metadata,
            }
        )
        return self._write(done)


def _now() -> datetime:
    return datetime.now(tz=UTC)
