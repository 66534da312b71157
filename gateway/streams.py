"""Read streaming jobs' text deltas (``worker.streams``) as they arrive, once each, with one
reader per gateway process.

A reader per stream would hold a pooled connection in ``XREAD BLOCK`` for as long as its job
runs: a hundred streams took the pool's connections from every other request. Here one
task (``StreamHub``) blocks on one connection of its own in a single ``XREAD`` over every
stream followed, and hands each follower its entries; a new follower interrupts that read
(``CLIENT UNBLOCK``) so it is read from at once.

A stream ends with the marker the job's terminal write appends (``STREAM_END``), which holds
the job's final record: a follower need not read the record. A job admitted for a caller
that streams has its stream from the start (``STREAM_OPENED``), so even one that failed
before it streamed a word ends with the marker. Any other (a replayed request following an
earlier request's job, whose stream may have expired, or never existed) is also watched on
the job-events channel (``gateway.waiter``), and its follower reads the record when the job
may have ended. A follower of either kind that hears nothing for ``recheck_s`` reads the
record too (a stream lost with a Redis that restarted empty). A job redelivered after a
crash streams again from its first token under a new execution tag; text the caller already
received is skipped, so the caller sees every character exactly once. If the new attempt's
text diverges (sampled, not greedy), the stream can't be continued consistently and ends with
``StreamDiverged``.

The stream is the record of truth: if Redis goes away for a moment (a restart, a failover),
the reader resumes from the last entry each follower received, and the followers wait, as
long as their requests' time lasts.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from typing import Any

from redis.asyncio import Redis
from redis.exceptions import RedisError

from contracts.job_records import job_of
from contracts.jobs import JobPublic
from contracts.keys import STREAM_END, STREAM_OPENED_ID, stream_key
from contracts.redis_policy import async_options
from gateway import job_store
from gateway.background import LoopTask
from gateway.waiter import JobWaiter

log = logging.getLogger(__name__)

BLOCK_MS = 250
"""Longest one shared read blocks. Followers added meanwhile interrupt it, so this bounds only
the wait of a follower whose interruption arrived just before the read was sent (or a Redis
that refuses ``CLIENT UNBLOCK``): its first text comes at most this late."""

BATCH = 512
"""Entries taken per stream per read."""

RETRY_S = (0.1, 1.0)
"""First and longest pause between reads while Redis is unreachable."""

Entry = tuple[str, dict[str, str]]


def reader_client(url: str, connect_timeout_s: float, **options: Any) -> Redis:
    """The hub's own client: one connection with no socket timeout (its read blocks), and no
    retries of its own. Its connection's client id is what ``CLIENT UNBLOCK`` names; a
    silent reconnect inside a retry would change it behind the hub's back, so an error
    reaches the hub, which reconnects and reads the new id."""
    return Redis.from_url(
        url,
        socket_connect_timeout=connect_timeout_s,
        health_check_interval=30,
        decode_responses=True,
        single_connection_client=True,
        **async_options(retries=0),
        **options,
    )


class StreamDiverged(Exception):
    """A later attempt produced different text than what was already sent."""


@dataclass
class _Dedup:
    sent: str = ""
    attempt: str | None = None
    attempt_text: str = ""

    def fresh(self, attempt: str, text: str) -> str:
        """The part of ``text`` (the next delta of ``attempt``) not sent yet."""
        if attempt != self.attempt:
            self.attempt, self.attempt_text = attempt, ""
        before = len(self.attempt_text)
        self.attempt_text += text
        if len(self.attempt_text) <= len(self.sent):
            if not self.sent.startswith(self.attempt_text):
                raise StreamDiverged
            return ""
        if not self.attempt_text.startswith(self.sent):
            raise StreamDiverged
        new = self.attempt_text[max(before, len(self.sent)) :]
        self.sent += new
        return new


def _id(entry_id: str) -> tuple[int, int]:
    ms, _, seq = entry_id.partition("-")
    return int(ms), int(seq or 0)


def _earliest(followers: set[_Follower]) -> str:
    """The earliest position among ``followers`` (mostly one)."""
    if len(followers) == 1:
        for follower in followers:
            return follower.position
    return min((f.position for f in followers), key=_id)


@dataclass(eq=False)
class _Follower:
    """One request following a stream: where it is in it, and what it was handed."""

    position: str = "0-0"
    entries: list[Entry] = field(default_factory=list)
    ready: asyncio.Event = field(default_factory=asyncio.Event)
    maybe_finished: bool = False

    def finished(self) -> None:
        """The job-events channel says the job may have ended."""
        self.maybe_finished = True
        self.ready.set()

    def take(self, entries: list[Entry]) -> None:
        """Hand over those of ``entries`` past this follower's position."""
        if not entries:
            return
        after = _id(self.position)
        # A reply's entries come in order; mostly all are new (one follower per stream).
        if _id(entries[0][0]) > after:
            fresh = entries
        else:
            fresh = [entry for entry in entries if _id(entry[0]) > after]
        if fresh:
            self.position = fresh[-1][0]
            self.entries.extend(fresh)
            self.ready.set()


class StreamHub(LoopTask):
    """The process's stream reader. ``start`` it on the event loop, ``follow`` streams."""

    def __init__(self, reader: Redis, pool: Redis, waiter: JobWaiter) -> None:
        """``reader``: a client of one connection, for the blocking read only (no socket
        timeout); ``pool``: the process's client, for the rest."""
        super().__init__("stream-hub")
        self._reader = reader
        self._pool = pool
        self._waiter = waiter
        # Most streams have one follower; a replayed request (the same idempotency key)
        # follows the same job's stream again, from its start, beside the first.
        self._followers: dict[str, set[_Follower]] = {}
        self._changed = asyncio.Event()
        self._reader_id: int | None = None
        self._blocked = False
        self._unblocking = False
        self._pending: set[asyncio.Task[None]] = set()

    async def run(self) -> None:
        pause = RETRY_S[0]
        while True:
            if not self._followers:
                self._changed.clear()
                await self._changed.wait()
                continue
            # As bytes: redis-py packs a str argument through several Python calls (124
            # against 71 us to pack a read of 64 streams here), and every read names every
            # stream.
            streams: dict[Any, Any] = {
                key.encode(): _earliest(followers).encode()
                for key, followers in self._followers.items()
            }
            self._changed.clear()
            try:
                if self._reader_id is None:
                    self._reader_id = int(await self._reader.client_id())
                self._blocked = True
                replies: Any = await self._reader.xread(streams, count=BATCH, block=BLOCK_MS)
            except (RedisError, OSError) as exc:
                self._reader_id = None  # a reconnected client has a new id
                log.warning("stream reader: Redis unreachable (%s); retrying", exc)
                await asyncio.sleep(pause)
                pause = min(pause * 2, RETRY_S[1])
                continue
            finally:
                self._blocked = False
            pause = RETRY_S[0]
            for key, entries in replies or ():
                for follower in self._followers.get(key, ()):
                    follower.take(entries)

    def _interrupt(self) -> None:
        """Make the reader read again with the current set of streams, now."""
        self._changed.set()
        if not self._blocked or self._unblocking or self._reader_id is None:
            return
        self._unblocking = True
        task = asyncio.get_running_loop().create_task(self._unblock(self._reader_id))
        self._pending.add(task)
        task.add_done_callback(self._pending.discard)

    async def _unblock(self, reader_id: int) -> None:
        try:
            await self._pool.client_unblock(reader_id)
        except (RedisError, OSError) as exc:
            log.debug("could not interrupt the stream reader: %s", exc)
        finally:
            self._unblocking = False

    async def follow(
        self, job: JobPublic, timeout_s: float, opened: bool = False
    ) -> AsyncIterator[str | JobPublic]:
        """Yield ``job``'s text as the worker produces it (the deltas that reach this
        follower together as one), then the job once it is terminal (or as it is when
        ``timeout_s`` runs out). ``opened``: this request admitted the job with its stream
        opened (``STREAM_OPENED``), so the stream will hold its end. Redis errors propagate
        only when Redis stayed away until then."""
        key = stream_key(job.id)
        # Past the entry that opened the stream: reading it would wake this follower for
        # nothing.
        follower = _Follower(STREAM_OPENED_ID) if opened else _Follower()
        loop = asyncio.get_running_loop()
        deadline = loop.time() + timeout_s
        dedup = _Dedup()
        final: JobPublic | None = None
        self._followers.setdefault(key, set()).add(follower)
        self._interrupt()
        if not opened:
            # A job that ended before this follower was registered, without streaming
            # anything, may have no stream and sent its event to nobody: look at its record.
            follower.finished()
        watch = (
            contextlib.nullcontext()
            if opened
            else self._waiter.notifying(job.id, follower.finished)
        )
        try:
            with watch:
                while loop.time() < deadline:
                    if not follower.ready.is_set():  # mostly set under load: no timer then
                        wait_s = min(deadline - loop.time(), self._waiter.recheck_s)
                        with contextlib.suppress(TimeoutError):
                            async with asyncio.timeout(wait_s):
                                await follower.ready.wait()
                    follower.ready.clear()
                    entries, follower.entries = follower.entries, []
                    texts, end = _texts(entries, dedup)
                    if texts:
                        # What reached this follower since it last ran goes out as one
                        # delta: a gateway behind under load sends fewer, larger chunks
                        # instead of falling further behind.
                        yield "".join(texts)
                    if end is not None:
                        # The same job, so the same tenant; checked all the same, as a read
                        # of the record is (``job_store.get_job``).
                        if end.job is not None and end.job.tenant == job.tenant:
                            final = end.job
                        break
                    if follower.maybe_finished or not entries:
                        # Woken by the job-events channel, or nothing arrived for a while: a
                        # job that ended without a marker has none to wait for.
                        follower.maybe_finished = False
                        tail = await self._tail(job, key, follower, dedup)
                        if tail is not None:
                            rest, final = tail
                            if rest:
                                yield "".join(rest)
                            break
        finally:
            self._unfollow(key, follower)
        if final is None:  # not read yet: the time ran out, or a marker without the record
            final = await self._record(job, deadline)
        if final is not None:
            yield final

    def _unfollow(self, key: str, follower: _Follower) -> None:
        followers = self._followers.get(key)
        if followers is not None:
            followers.discard(follower)
            if not followers:
                del self._followers[key]

    async def _tail(
        self, job: JobPublic, key: str, follower: _Follower, dedup: _Dedup
    ) -> tuple[list[str], JobPublic | None] | None:
        """If ``job`` is terminal (or gone), the text of its stream not received yet (the
        worker completes a stream before it stores the outcome) and the job as read;
        ``None`` while it runs, or while Redis is away."""
        try:
            current = await job_store.get_job(self._pool, job.id, job.tenant)
            if current is not None and not current.status.terminal:
                return None
            # Taken from the reader in one step: it delivers nothing more to this follower.
            self._unfollow(key, follower)
            entries, start = follower.entries, follower.position
            rest: list[Entry] = await self._pool.xrange(key, min=f"({start}", max="+")  # type: ignore[assignment]
            entries += rest
        except (RedisError, OSError):
            self._followers.setdefault(key, set()).add(follower)
            return None
        return _texts(entries, dedup)[0], current

    async def _record(self, job: JobPublic, deadline: float) -> JobPublic | None:
        """The job's record, read again until ``deadline`` while Redis is away."""
        loop = asyncio.get_running_loop()
        pause = RETRY_S[0]
        while True:
            try:
                return await job_store.get_job(self._pool, job.id, job.tenant)
            except (RedisError, OSError):
                if loop.time() + pause >= deadline:
                    raise
            await asyncio.sleep(pause)
            pause = min(pause * 2, RETRY_S[1])


@dataclass(frozen=True)
class _End:
    """A stream's end marker: the job as its terminal write stored it (``None`` from a writer
    that did not put the record in the marker)."""

    job: JobPublic | None


def _texts(entries: list[Entry], dedup: _Dedup) -> tuple[list[str], _End | None]:
    """The new text in ``entries``, and the stream's end marker if they reach it."""
    texts: list[str] = []
    for _, fields in entries:
        if STREAM_END in fields:  # written with the terminal record: nothing follows
            record = fields.get("record")
            status, attempts = fields[STREAM_END], fields.get("attempts")
            return texts, _End(job_of((record, status, attempts, None, None)))
        if "text" not in fields:  # the entry that opened the stream (``STREAM_OPENED``)
            continue
        text = dedup.fresh(fields["attempt"], fields["text"])
        if text:
            texts.append(text)
    return texts, None
