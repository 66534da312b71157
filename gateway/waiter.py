"""Long-polling for job completion without polling Redis per request.

One subscription per gateway process to the job-events channel wakes every request waiting
for that job. Events published while the subscription is down are lost, so every waiter is
woken to read its record again each time the subscription is (re)established; a waiter
also reads it every ``recheck_s`` in case the connection died without telling (a half-open
socket until the health check notices). A lost event costs latency, never correctness.

The same subscription listens on the process's own reply channel (``replies``), on which a job
admitted for a caller waiting here has its final record published (``reply_to`` of the
admission, ``contracts.job_records.ADVANCE``) just before its id goes out on the events
channel: that waiter takes the record from the message instead of reading it back.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import uuid
from collections import defaultdict
from collections.abc import AsyncIterator, Callable, Iterator

from redis.asyncio import Redis
from redis.exceptions import RedisError

from contracts.job_records import reply_id, reply_job
from contracts.jobs import JobPublic
from contracts.keys import JOB_EVENTS, reply_channel
from gateway import job_store
from gateway.background import LoopTask

log = logging.getLogger(__name__)

RECHECK_S = 5.0
"""How often a waiter reads its job's record even though no event woke it."""


class JobWaiter(LoopTask):
    def __init__(self, redis: Redis, recheck_s: float = RECHECK_S) -> None:
        super().__init__("job-events")
        self._redis = redis
        self.recheck_s = recheck_s
        self._watchers: dict[str, set[Callable[[], None]]] = defaultdict(set)
        self.replies = reply_channel(uuid.uuid4().hex)
        """This process's reply channel: name it as the ``reply_to`` of a job whose caller
        waits here (``wait_watched`` then takes the final record from the channel)."""
        self._replied: dict[str, str] = {}
        """Watched job id -> its reply message (parsed by the waiter that takes it)."""
        self.listening = asyncio.Event()
        """Set while subscribed to both channels (once every waiter was woken for it)."""

    async def run(self) -> None:
        while True:
            try:
                async with self._redis.pubsub() as pubsub:
                    await pubsub.subscribe(JOB_EVENTS, self.replies)
                    async for message in pubsub.listen():
                        kind = message.get("type")
                        if kind == "message":
                            data = str(message["data"])
                            if message["channel"] == self.replies:
                                job_id = reply_id(data)
                                if job_id not in self._watchers:
                                    continue
                                self._replied[job_id] = data
                            else:
                                job_id = data
                            for notify in list(self._watchers.get(job_id, ())):
                                notify()
                        elif kind == "subscribe" and message["channel"] == self.replies:
                            # Listening (again), to both channels (subscribed in this order):
                            # what finished meanwhile published to nobody.
                            self._wake_all()
                            self.listening.set()
            except (RedisError, OSError) as exc:
                self.listening.clear()
                log.warning("job-events subscription lost (%s); reconnecting", exc)
                await asyncio.sleep(1.0)

    def _wake_all(self) -> None:
        for watchers in list(self._watchers.values()):
            for notify in list(watchers):
                notify()

    @contextlib.contextmanager
    def notifying(self, job_id: str, notify: Callable[[], None]) -> Iterator[None]:
        """Call ``notify()`` (on the event loop) whenever ``job_id`` may have finished: its
        event arrived, or events may have been missed. Register before reading the record."""
        self._watchers[job_id].add(notify)
        try:
            yield
        finally:
            self._watchers[job_id].discard(notify)
            if not self._watchers[job_id]:
                del self._watchers[job_id]
                self._replied.pop(job_id, None)

    @contextlib.asynccontextmanager
    async def watching(self, job_id: str) -> AsyncIterator[asyncio.Event]:
        """An event set when ``job_id`` may have finished (``notifying``)."""
        event = asyncio.Event()
        with self.notifying(job_id, event.set):
            yield event

    async def sleep(self, event: asyncio.Event, timeout_s: float) -> None:
        """Until ``event`` is set or ``min(timeout_s, recheck_s)`` passed; clears it."""
        with contextlib.suppress(TimeoutError):
            await asyncio.wait_for(event.wait(), min(timeout_s, self.recheck_s))
        event.clear()

    async def wait(
        self, redis: Redis, job_id: str, tenant: str, timeout_s: float
    ) -> JobPublic | None:
        """The job once terminal, or as it is after ``timeout_s``; ``None`` if there is no
        such job for ``tenant``. Redis errors propagate."""
        async with self.watching(job_id) as finished:
            return await self.wait_watched(redis, job_id, tenant, timeout_s, finished, False)

    async def wait_watched(
        self,
        redis: Redis,
        job_id: str,
        tenant: str,
        timeout_s: float,
        finished: asyncio.Event,
        unread: bool,
    ) -> JobPublic | None:
        """``wait`` with the caller's own ``notifying`` registration setting ``finished``.
        ``unread``: the caller registered it before the job existed (it admitted the job
        itself), so the job cannot have ended unnoticed and its record is first read when
        ``finished`` is set (or after ``recheck_s``): one read fewer. A final record that
        came on ``replies`` is not read at all."""
        deadline = asyncio.get_running_loop().time() + timeout_s
        if unread:
            await self.sleep(finished, timeout_s)
        while True:
            job = self._reply(job_id, tenant) or await job_store.get_job(redis, job_id, tenant)
            remaining = deadline - asyncio.get_running_loop().time()
            if job is None or job.status.terminal or remaining <= 0:
                return job
            await self.sleep(finished, remaining)

    def _reply(self, job_id: str, tenant: str) -> JobPublic | None:
        """``job_id``'s final record, if it came on ``replies`` (and is ``tenant``'s)."""
        reply = self._replied.get(job_id)
        if reply is None:
            return None
        job = reply_job(reply)
        return job if job.tenant == tenant else None
