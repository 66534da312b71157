"""Long-polling for job completion without polling Redis per request.

One subscription per gateway process to the job-events channel wakes every request waiting
for that job. Events can be missed while the subscription reconnects, so waiters also
re-read the record every ``recheck_s``: a lost event costs latency, never correctness.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections import defaultdict
from collections.abc import AsyncIterator

from redis.asyncio import Redis
from redis.exceptions import RedisError

from contracts.jobs import JobPublic
from contracts.keys import JOB_EVENTS
from gateway import job_store

log = logging.getLogger(__name__)


class JobWaiter:
    def __init__(self, redis: Redis, recheck_s: float = 1.0) -> None:
        self._redis = redis
        self._recheck_s = recheck_s
        self._events: dict[str, set[asyncio.Event]] = defaultdict(set)
        self._task: asyncio.Task[None] | None = None

    def start(self) -> None:
        self._task = asyncio.create_task(self._listen(), name="job-events")

    async def stop(self) -> None:
        if self._task is not None:
            self._task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._task

    async def _listen(self) -> None:
        while True:
            try:
                async with self._redis.pubsub() as pubsub:
                    await pubsub.subscribe(JOB_EVENTS)
                    async for message in pubsub.listen():
                        if message.get("type") == "message":
                            for event in self._events.get(str(message["data"]), ()):
                                event.set()
            except (RedisError, OSError) as exc:
                log.warning("job-events subscription lost (%s); reconnecting", exc)
                await asyncio.sleep(self._recheck_s)

    @contextlib.asynccontextmanager
    async def watching(self, job_id: str) -> AsyncIterator[asyncio.Event]:
        """An event set when ``job_id`` finishes; register before reading the record."""
        event = asyncio.Event()
        self._events[job_id].add(event)
        try:
            yield event
        finally:
            self._events[job_id].discard(event)
            if not self._events[job_id]:
                del self._events[job_id]

    async def sleep(self, event: asyncio.Event, timeout_s: float) -> None:
        """Until ``event`` is set or ``min(timeout_s, recheck_s)`` passed."""
        with contextlib.suppress(TimeoutError):
            await asyncio.wait_for(event.wait(), min(timeout_s, self._recheck_s))

    async def wait(
        self, redis: Redis, job_id: str, tenant: str, timeout_s: float
    ) -> JobPublic | None:
        """The job once terminal, or as it is after ``timeout_s``; ``None`` if there is no
        such job for ``tenant``. Redis errors propagate."""
        deadline = asyncio.get_running_loop().time() + timeout_s
        async with self.watching(job_id) as finished:
            while True:
                job = await job_store.get_job(redis, job_id, tenant)
                remaining = deadline - asyncio.get_running_loop().time()
                if job is None or job.status.terminal or remaining <= 0:
                    return job
                await self.sleep(finished, remaining)
