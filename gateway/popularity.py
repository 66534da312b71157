"""Decayed request counts per adapter revision and pool (``contracts.popularity``), counted
here at admission and written once a second: a gateway adds one pipelined round trip a
second, not one per job. A gateway that dies loses at most its last second of counts: they
steer prefetching only."""

from __future__ import annotations

import asyncio
import logging
import threading
import time

from redis.asyncio import Redis
from redis.exceptions import RedisError

from contracts import popularity
from contracts.jobs import JobPublic
from gateway.background import LoopTask

log = logging.getLogger(__name__)


class PopularityCounter(LoopTask):
    def __init__(self, redis: Redis, top_k: int, flush_s: float = 1.0) -> None:
        super().__init__("popularity")
        self._redis = redis
        self._top_k = top_k
        self._flush_s = flush_s
        self._add = redis.register_script(popularity.ADD)
        self._lock = threading.Lock()
        # (pool, epoch) -> member -> summed weight
        self._pending: dict[tuple[str, int], dict[str, float]] = {}

    def count(self, jobs: list[JobPublic]) -> None:
        """Admitted ``jobs`` (never a replay): each adds its weight to its pool's set."""
        now = time.time()
        epoch = popularity.epoch_of(now)
        weight = popularity.weight(now, epoch)
        with self._lock:
            for job in jobs:
                pool = job.queue.rsplit(".", 1)[-1]
                pending = self._pending.setdefault((pool, epoch), {})
                entry = popularity.member(job.revision, job.adapter)
                pending[entry] = pending.get(entry, 0.0) + weight

    async def flush(self) -> None:
        with self._lock:
            pending, self._pending = self._pending, {}
        if not pending:
            return
        async with self._redis.pipeline(transaction=False) as pipe:
            for (pool, epoch), weights in pending.items():
                args: list[str | int | float] = [self._top_k, popularity.KEY_TTL_S]
                for entry, added in weights.items():
                    args += [entry, repr(added)]
                await self._add(
                    keys=[popularity.popularity_key(pool, epoch)], args=args, client=pipe
                )
            await pipe.execute()

    async def run(self) -> None:
        while True:
            await asyncio.sleep(self._flush_s)
            try:
                await self.flush()
            except (RedisError, OSError) as exc:
                log.warning("popularity counts not written (%s); dropped", exc)
            except Exception:  # never let the task end: counts would stop for good
                log.exception("popularity counts not written; dropped")

    async def stop(self) -> None:
        await super().stop()
        try:
            await asyncio.wait_for(self.flush(), 2.0)
        except Exception as exc:  # shutdown goes on whatever happens here
            log.warning("popularity counts not written at shutdown (%r)", exc)
