"""Text deltas of streaming jobs, appended to a Redis stream per job as they are produced.

Entries carry the attempt number: after a crash and redelivery the new attempt streams from
the start again, and the reader (the gateway) skips what it already sent. The stream expires
``STREAM_TTL_S`` after its last entry; the job record keeps the full result regardless.
"""

from __future__ import annotations

import asyncio

from redis import Redis

from contracts.keys import stream_key

STREAM_TTL_S = 3600


class DeltaPublisher:
    def __init__(self, redis: Redis) -> None:
        self._redis = redis

    def _append(self, job_id: str, attempt: int, text: str) -> None:
        key = stream_key(job_id)
        pipe = self._redis.pipeline(transaction=False)
        pipe.xadd(key, {"attempt": attempt, "text": text})
        pipe.expire(key, STREAM_TTL_S)
        pipe.execute()

    async def publish(self, job_id: str, attempt: int, text: str) -> None:
        """Append one delta; off the engine loop's thread (a Redis round trip must not stall
        the loop every other request is generating on)."""
        await asyncio.to_thread(self._append, job_id, attempt, text)
