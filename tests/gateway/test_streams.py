"""Reading a job's stream: a redelivered job's text once, the end as soon as it is written."""

from __future__ import annotations

import asyncio
import threading
import time

import pytest
from redis import Redis
from redis.asyncio import Redis as AsyncRedis

from contracts.job_records import ADVANCE, advance_call
from contracts.jobs import JobPublic, JobStatus
from contracts.keys import job_key, stream_key
from gateway import streams
from gateway.streams import StreamDiverged, _Dedup
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


def test_a_reader_ends_at_the_end_marker_without_waiting_for_a_timeout(
    infra: LocalStack, redis: Redis, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The reader blocks on the stream with no timeout at all: only the end marker, written
    with the terminal record, can end it (before the marker, each stream ended a blocked
    read's 200 ms after its last token)."""
    monkeypatch.setattr(streams, "BLOCK_MS", 0)  # XREAD BLOCK 0: wait for ever
    job = new_job(status=JobStatus.RUNNING, attempts=1)
    redis.hset(job_key(job.id), mapping={"status": "running", "record": job.model_dump_json()})
    redis.hset(job_key(job.id), "attempts", 1)

    async def read() -> list[str | JobPublic]:
        client = AsyncRedis.from_url(infra.redis_url, decode_responses=True)
        try:
            return [item async for item in streams.follow(client, job.id, "t", timeout_s=600)]
        finally:
            await client.aclose()

    def worker() -> None:
        time.sleep(0.5)  # the reader is blocked by now
        for text in ("Hel", "lo"):
            redis.xadd(stream_key(job.id), {"attempt": "w|1", "text": text})
        done = job.model_copy(update={"status": JobStatus.SUCCEEDED})
        keys, args = advance_call(done, 60)
        redis.register_script(ADVANCE)(keys=keys, args=args)

    writer = threading.Thread(target=worker)
    writer.start()
    items = asyncio.run(asyncio.wait_for(read(), timeout=120))  # a hang fails, not a bound
    writer.join()
    assert items[:-1] == ["Hel", "lo"]
    final = items[-1]
    assert isinstance(final, JobPublic) and final.status == JobStatus.SUCCEEDED
