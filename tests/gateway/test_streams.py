"""Reading a job's stream: a redelivered job's text once, the end as soon as it is written."""

from __future__ import annotations

import asyncio
import threading
import time
import uuid
from concurrent.futures import Future
from typing import Any

import pytest
from redis import Redis
from redis.asyncio import Redis as AsyncRedis

from contracts.job_records import ADVANCE, advance_call
from contracts.jobs import JobPublic, JobStatus
from contracts.keys import STREAM_END, STREAM_OPENED, STREAM_OPENED_ID, job_key, stream_key
from contracts.redis_policy import async_client
from gateway import streams
from gateway.streams import StreamDiverged, StreamHub, _Dedup, reader_client
from gateway.waiter import JobWaiter
from lorafleet.stack import LocalStack
from tests.helpers import new_job


def test_a_new_attempt_resends_nothing_already_sent() -> None:
    dedup = _Dedup()
    assert dedup.fresh("1", "The qu") == "The qu"
    assert dedup.fresh("1", "ick") == "ick"
    # The worker died; attempt 2 streams from the first token again.
    assert dedup.fresh("2", "The") == ""
    assert dedup.fresh("2", " quick br") == " br"
    assert dedup.fresh("2", "own fox") == "own fox"
    assert dedup.sent == "The quick brown fox"


def test_a_new_attempt_that_says_something_else_ends_the_stream() -> None:
    dedup = _Dedup()
    dedup.fresh("1", "The quick")
    with pytest.raises(StreamDiverged):
        dedup.fresh("2", "A slow")


class Hub:
    """A ``StreamHub`` with its waiter on the session's Redis, as the gateway runs them, in a
    loop on a thread of its own; ``follow`` reads one stream to its end from any thread."""

    def __init__(self, url: str, max_connections: int = 8, recheck_s: float = 600) -> None:
        self._url, self._max, self._recheck_s = url, max_connections, recheck_s
        self.name = f"hub-{uuid.uuid4().hex[:8]}"
        self.loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self.loop.run_forever, daemon=True)

    def __enter__(self) -> Hub:
        self._thread.start()
        asyncio.run_coroutine_threadsafe(self._start(), self.loop).result(30)
        return self

    async def _start(self) -> None:
        self.pool = async_client(self._url, self._max, pool_timeout_s=5, decode_responses=True)
        # Named, so that a test can cut exactly these connections in a shared Redis.
        self._events = AsyncRedis.from_url(
            self._url, decode_responses=True, client_name=f"{self.name}-events"
        )
        self._reader = reader_client(self._url, 5, client_name=f"{self.name}-reader")
        self.waiter = JobWaiter(self._events, recheck_s=self._recheck_s)
        self.waiter.start()
        self.hub = StreamHub(self._reader, self.pool, self.waiter)
        self.hub.start()
        while "stream-hub" not in {t.get_name() for t in asyncio.all_tasks()}:
            await asyncio.sleep(0.01)
        # Subscribed (Redis confirmed both channels; a fixed pause was once too short), and
        # every waiter woken for it already (none are yet): a waiter registered from now on is
        # woken only by what the channels bring. Within ``__enter__``'s 30 s.
        await asyncio.wait_for(self.waiter.listening.wait(), 25)

    def follow(
        self, job: JobPublic, timeout_s: float = 600, opened: bool = False
    ) -> Future[list[str | JobPublic]]:
        async def read() -> list[str | JobPublic]:
            return [item async for item in self.hub.follow(job, timeout_s, opened)]

        return asyncio.run_coroutine_threadsafe(read(), self.loop)

    def __exit__(self, *_: object) -> None:
        async def stop() -> None:
            await self.hub.stop()
            await self.waiter.stop()
            for client in (self.pool, self._events, self._reader):
                await client.aclose()

        asyncio.run_coroutine_threadsafe(stop(), self.loop).result(30)
        self.loop.call_soon_threadsafe(self.loop.stop)
        self._thread.join(30)


def _kill(redis: Redis, name: str, command: str | None = None) -> int:
    """Close the connections named ``name``, once there is one (whose last command was
    ``command``, if given); how many there were."""

    def named() -> list[dict[str, Any]]:
        return [
            client
            for client in redis.client_list()
            if client.get("name") == name and command in (None, client.get("cmd"))
        ]

    deadline = time.monotonic() + 60
    while not (clients := named()):
        assert time.monotonic() < deadline, f"no connection {name} ({command}) to kill"
        time.sleep(0.01)
    return sum(int(redis.client_kill_filter(_id=client["id"])) for client in clients)


def _reads_counted(monkeypatch: pytest.MonkeyPatch) -> list[str]:
    """The ids of the job records the waiter reads from now on, in order."""
    from gateway import waiter as waiter_module

    reads: list[str] = []
    real_get_job = waiter_module.job_store.get_job

    async def counted(pool: AsyncRedis, job_id: str, tenant: str) -> JobPublic | None:
        reads.append(job_id)
        return await real_get_job(pool, job_id, tenant)

    monkeypatch.setattr(waiter_module.job_store, "get_job", counted)
    return reads


def _first_read(reads: list[str], job_id: str) -> None:
    """Wait (60 s at most) until the waiter has read ``job_id``'s record."""
    deadline = time.monotonic() + 60
    while job_id not in reads:
        assert time.monotonic() < deadline, "the long-poll never read its job"
        time.sleep(0.01)


def _running(redis: Redis, opened: bool = False) -> JobPublic:
    """A running job; ``opened``: its stream was opened at its admission."""
    job = new_job(status=JobStatus.RUNNING, attempts=1)
    redis.hset(job_key(job.id), mapping={"status": "running", "record": job.model_dump_json()})
    redis.hset(job_key(job.id), "attempts", 1)
    if opened:
        redis.xadd(stream_key(job.id), {STREAM_OPENED: "1"}, id=STREAM_OPENED_ID)
    return job


def _finish(redis: Redis, job: JobPublic, status: JobStatus = JobStatus.SUCCEEDED) -> None:
    keys, args = advance_call(job.model_copy(update={"status": status}), 60)
    redis.register_script(ADVANCE)(keys=keys, args=args)


def _write(redis: Redis, job: JobPublic, *texts: str, attempt: str = "w|1") -> None:
    for text in texts:
        redis.xadd(stream_key(job.id), {"attempt": attempt, "text": text})


def test_a_follower_ends_at_the_end_marker_without_waiting_for_a_timeout(
    infra: LocalStack, redis: Redis, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The shared read blocks with no timeout at all and followers never look again on their
    own: only the end marker, written with the terminal record, can end the stream (before
    the marker, each stream ended a blocked read's 200 ms after its last token)."""
    monkeypatch.setattr(streams, "BLOCK_MS", 0)  # XREAD BLOCK 0: wait for ever
    job = _running(redis)
    with Hub(infra.redis_url) as hub:
        reading = hub.follow(job)
        time.sleep(0.5)  # the reader is blocked by now
        _write(redis, job, "Hel", "lo")
        _finish(redis, job)
        items = reading.result(timeout=120)  # a hang fails, not a bound
    assert "".join(str(item) for item in items[:-1]) == "Hello"
    final = items[-1]
    assert isinstance(final, JobPublic) and final.status == JobStatus.SUCCEEDED


def test_a_stream_opened_at_admission_is_followed_without_a_read_of_the_record(
    infra: LocalStack, redis: Redis, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A request that admitted its job with the stream opened reads nothing but the stream:
    the end marker carries the outcome (the record as the terminal write stored it). Here
    no event, no timeout and no record read could end it instead (``BLOCK_MS`` 0, recheck
    600 s, the record reads counted)."""
    monkeypatch.setattr(streams, "BLOCK_MS", 0)
    reads = _reads_counted(monkeypatch)
    handed: list[str] = []  # the ids of the entries the follower was handed
    real_texts = streams._texts

    def texts(entries: list[streams.Entry], dedup: _Dedup) -> Any:
        handed.extend(entry_id for entry_id, _ in entries)
        return real_texts(entries, dedup)

    monkeypatch.setattr(streams, "_texts", texts)
    job = _running(redis, opened=True)
    with Hub(infra.redis_url) as hub:
        reading = hub.follow(job, opened=True)
        time.sleep(0.5)
        _write(redis, job, "Hel", "lo")
        _finish(redis, job)
        items = reading.result(timeout=120)
    assert "".join(str(item) for item in items[:-1]) == "Hello"
    final = items[-1]
    assert isinstance(final, JobPublic) and final.status == JobStatus.SUCCEEDED
    assert final == job.model_copy(update={"status": JobStatus.SUCCEEDED})
    assert reads == []
    # Read from past the opening entry: nothing woke the follower before the text.
    assert handed and STREAM_OPENED_ID not in handed


def test_a_job_that_fails_before_streaming_ends_its_opened_stream_with_the_marker(
    infra: LocalStack, redis: Redis, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A job admitted with its stream opened that fails before it streams a word (a tampered
    adapter) still has a stream for its terminal write to mark: the follower ends there,
    with the failure, without the job-events channel or a read of the record. It also ends
    so when the job failed before the follower came."""
    monkeypatch.setattr(streams, "BLOCK_MS", 0)
    reads = _reads_counted(monkeypatch)
    early, late = _running(redis, opened=True), _running(redis, opened=True)
    _finish(redis, early, JobStatus.FAILED)
    with Hub(infra.redis_url) as hub:
        readings = [hub.follow(job, opened=True) for job in (early, late)]
        time.sleep(0.5)
        _finish(redis, late, JobStatus.FAILED)
        results = [reading.result(timeout=120) for reading in readings]
    for items in results:
        assert len(items) == 1
        assert isinstance(items[0], JobPublic) and items[0].status == JobStatus.FAILED
    assert reads == []


def test_an_end_marker_without_the_record_makes_the_follower_read_it(
    infra: LocalStack, redis: Redis, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A marker written by an older worker (its status only, no record) still ends the
    stream: the follower then reads the record, once."""
    monkeypatch.setattr(streams, "BLOCK_MS", 0)
    reads = _reads_counted(monkeypatch)
    job = _running(redis, opened=True)
    with Hub(infra.redis_url) as hub:
        reading = hub.follow(job, opened=True)
        time.sleep(0.5)
        _write(redis, job, "Hi")
        done = job.model_copy(update={"status": JobStatus.SUCCEEDED})
        redis.hset(
            job_key(job.id), mapping={"status": "succeeded", "record": done.model_dump_json()}
        )
        redis.xadd(stream_key(job.id), {STREAM_END: "succeeded"})
        items = reading.result(timeout=120)
    assert items[:-1] == ["Hi"]
    assert items[-1] == done
    assert reads == [job.id]


def test_deltas_that_reach_a_follower_together_go_out_as_one(
    infra: LocalStack, redis: Redis
) -> None:
    """A follower behind its stream (here: it starts after three deltas were written) sends
    what it has in one piece, not one chunk per delta: a gateway busy with many streams
    writes fewer, larger chunks instead of falling further behind."""
    job = _running(redis)
    _write(redis, job, "one ", "two ", "three")
    with Hub(infra.redis_url) as hub:
        reading = hub.follow(job)
        time.sleep(0.5)  # the three have been read, most likely: one more comes later
        _write(redis, job, " four")
        _finish(redis, job)
        items = reading.result(timeout=120)
    # The three written before came in one read: one delta (with the fourth too, if the
    # machine stalled and it was written before that read).
    assert items[0] in ("one two three", "one two three four")
    assert "".join(str(item) for item in items[:-1]) == "one two three four"
    assert isinstance(items[-1], JobPublic) and items[-1].status == JobStatus.SUCCEEDED


def test_a_job_that_ends_without_streaming_ends_its_follower_through_its_event(
    infra: LocalStack, redis: Redis, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A job can fail before it streams a word (a tampered adapter): it has no stream and no
    end marker. Its terminal write's event ends the follower (which never looks again on its
    own here)."""
    monkeypatch.setattr(streams, "BLOCK_MS", 0)
    job = _running(redis)
    with Hub(infra.redis_url) as hub:
        reading = hub.follow(job)
        time.sleep(0.5)
        _finish(redis, job, JobStatus.FAILED)
        items = reading.result(timeout=120)
    assert len(items) == 1
    assert isinstance(items[0], JobPublic) and items[0].status == JobStatus.FAILED


def test_a_job_that_ended_before_its_follower_came_ends_it_at_once(
    infra: LocalStack, redis: Redis, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The job failed, with no stream, before the request began to follow it: its event went
    to nobody and no end marker will come. The follower looks at the record when it starts
    (it would otherwise wait out its recheck, 600 s here)."""
    monkeypatch.setattr(streams, "BLOCK_MS", 0)
    job = _running(redis)
    _finish(redis, job, JobStatus.FAILED)
    with Hub(infra.redis_url) as hub:
        items = hub.follow(job).result(timeout=60)
    assert len(items) == 1
    assert isinstance(items[0], JobPublic) and items[0].status == JobStatus.FAILED


def test_two_requests_follow_one_stream_and_each_reads_all_of_it(
    infra: LocalStack, redis: Redis
) -> None:
    """A replayed request (the same idempotency key) follows the job its first copy follows
    (which admitted it, its stream opened): the second joins midway and still reads the text
    from its start, the opening entry included (it did not open the stream, so reads it all);
    each gets every delta once."""
    job = _running(redis, opened=True)
    with Hub(infra.redis_url) as hub:
        first = hub.follow(job, opened=True)
        time.sleep(0.5)
        _write(redis, job, "one ", "two ")
        time.sleep(0.5)  # the first has read those
        second = hub.follow(job)
        time.sleep(0.5)
        _write(redis, job, "three")
        _finish(redis, job)
        results = [reading.result(timeout=120) for reading in (first, second)]
    for items in results:
        assert "".join(str(item) for item in items[:-1]) == "one two three"
        assert isinstance(items[-1], JobPublic) and items[-1].status == JobStatus.SUCCEEDED


def test_hundreds_of_streams_are_read_over_one_connection_beside_a_small_pool(
    infra: LocalStack, redis: Redis
) -> None:
    """300 streams followed at once through a hub whose process pool has 4 connections: the
    shared read holds one connection of its own, so every stream is read to its end (one
    reader per stream would have needed 300)."""
    jobs = [_running(redis) for _ in range(300)]
    with Hub(infra.redis_url, max_connections=4, recheck_s=1) as hub:
        readings = [hub.follow(job, timeout_s=120) for job in jobs]
        time.sleep(0.5)
        for round_ in range(3):
            for job in jobs:
                _write(redis, job, f"{job.id[:4]}-{round_} ")
        for job in jobs:
            _finish(redis, job)
        results = [reading.result(timeout=180) for reading in readings]
    for job, items in zip(jobs, results, strict=True):
        assert "".join(str(item) for item in items[:-1]) == "".join(
            f"{job.id[:4]}-{round_} " for round_ in range(3)
        )
        assert isinstance(items[-1], JobPublic) and items[-1].status == JobStatus.SUCCEEDED


def test_the_shared_read_resumes_after_its_connection_is_lost_without_loss_or_repeat(
    infra: LocalStack, redis: Redis
) -> None:
    """The reader's connection is killed between deltas (a Redis restart or failover looks
    the same to it): it reconnects and reads on from the last entry each follower got."""
    job = _running(redis)
    with Hub(infra.redis_url) as hub:
        reading = hub.follow(job)
        time.sleep(0.5)
        _write(redis, job, "one ")
        assert _kill(redis, f"{hub.name}-reader", "xread") == 1  # its shared XREAD
        _write(redis, job, "two ", "three")
        _finish(redis, job)
        items = reading.result(timeout=120)
    assert "".join(str(item) for item in items[:-1]) == "one two three"
    assert isinstance(items[-1], JobPublic) and items[-1].status == JobStatus.SUCCEEDED


def test_a_long_poll_learns_of_an_end_published_while_its_subscription_was_down(
    infra: LocalStack, redis: Redis, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The job-events subscription drops, and the job ends before it is back: that event
    reached nobody. Re-subscribed, the waiter wakes every request to read its record again
    (which here never looks again on its own)."""
    reads = _reads_counted(monkeypatch)
    job = _running(redis)
    with Hub(infra.redis_url) as hub:
        waiting = asyncio.run_coroutine_threadsafe(
            hub.waiter.wait(hub.pool, job.id, job.tenant, timeout_s=120), hub.loop
        )
        _first_read(reads, job.id)  # it has read the job running, and waits
        assert _kill(redis, f"{hub.name}-events") == 1  # its subscription
        _finish(redis, job)  # published while the waiter reconnects (it pauses 1 s first)
        finished = waiting.result(timeout=180)
    assert finished is not None and finished.status == JobStatus.SUCCEEDED


def test_a_completion_that_watched_before_admitting_reads_its_job_once(
    infra: LocalStack, redis: Redis, monkeypatch: pytest.MonkeyPatch
) -> None:
    """``POST /v1/completions`` registers for its job's end before it admits the job, so no
    end can pass unnoticed: without its record on the reply channel (a job whose hash names
    none, as one a worker older than the reply channel finishes), it reads the record once,
    when the end is announced (a long-poll of a job created elsewhere reads it first, then
    again at the end)."""
    reads = _reads_counted(monkeypatch)
    watched, polled = _running(redis), _running(redis)
    with Hub(infra.redis_url) as hub:

        async def watch() -> JobPublic | None:
            ended = asyncio.Event()
            with hub.waiter.notifying(watched.id, ended.set):
                return await hub.waiter.wait_watched(
                    hub.pool, watched.id, watched.tenant, 120, ended, unread=True
                )

        waiting = asyncio.run_coroutine_threadsafe(watch(), hub.loop)
        polling = asyncio.run_coroutine_threadsafe(
            hub.waiter.wait(hub.pool, polled.id, polled.tenant, 120), hub.loop
        )
        _first_read(reads, polled.id)  # the long-poll's first read, before the end
        _finish(redis, watched)
        _finish(redis, polled)
        finished = [waiting.result(timeout=60), polling.result(timeout=60)]
    assert all(job is not None and job.status == JobStatus.SUCCEEDED for job in finished)
    assert reads.count(watched.id) == 1
    assert reads.count(polled.id) == 2


def test_a_completion_whose_record_comes_on_its_reply_channel_reads_none(
    infra: LocalStack, redis: Redis, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A job admitted with this gateway's reply channel has its final record published there:
    the completion waiting for it answers from the message and reads nothing back. A waiter
    of another tenant is not answered from it (it reads, and finds no job of its own)."""
    reads = _reads_counted(monkeypatch)
    job = _running(redis)
    with Hub(infra.redis_url) as hub:
        redis.hset(job_key(job.id), "reply", hub.waiter.replies)  # as ``ADMIT`` writes it
        registered = threading.Event()

        async def watch(tenant: str) -> JobPublic | None:
            ended = asyncio.Event()
            with hub.waiter.notifying(job.id, ended.set):
                registered.set()
                return await hub.waiter.wait_watched(
                    hub.pool, job.id, tenant, 120, ended, unread=True
                )

        waiting = asyncio.run_coroutine_threadsafe(watch(job.tenant), hub.loop)
        assert registered.wait(60)
        registered.clear()
        stranger = asyncio.run_coroutine_threadsafe(watch("someone-else"), hub.loop)
        assert registered.wait(60)
        _finish(redis, job)
        finished, strangers = waiting.result(timeout=60), stranger.result(timeout=60)
    assert finished == job.model_copy(update={"status": JobStatus.SUCCEEDED})
    assert strangers is None
    assert reads == [job.id]  # the stranger's read only
