"""``worker.background.CoalescingWriter``: what it retries, what it drops, and closing."""

from __future__ import annotations

import logging
import threading

import pytest
from redis.exceptions import ConnectionError as RedisConnectionError
from redis.exceptions import ReadOnlyError, RedisError, ResponseError

from tests.helpers import until
from worker.background import CoalescingWriter


def _writer(write: object, give_up_s: float = 3600.0) -> CoalescingWriter[int]:
    return CoalescingWriter(
        "test-writer",
        write,  # type: ignore[arg-type]
        coalesce_s=0.0,
        retry_s=0.01,
        give_up_s=give_up_s,
        dropped="covered elsewhere",
    )


@pytest.mark.parametrize("outage", [RedisConnectionError, ReadOnlyError])
def test_an_error_reply_is_dropped_at_once_and_an_outage_is_retried(
    caplog: pytest.LogCaptureFixture, outage: type[RedisError]
) -> None:
    """Redis refusing a write as written would refuse it again: dropped, not retried. Redis
    away, or read-only for a failover: the same items are written once it takes them."""
    tries: list[list[int]] = []
    written: list[int] = []
    away = threading.Event()

    def write(items: list[int]) -> None:
        tries.append(list(items))
        if items[0] == 1:
            raise ResponseError("WRONGTYPE")
        if away.is_set():
            away.clear()
            raise outage("Redis cannot take it now")
        written.extend(items)

    writer = _writer(write)
    with caplog.at_level(logging.INFO, logger="worker.background"):
        try:
            assert writer.put(1)
            until(lambda: "dropped (covered elsewhere)" in caplog.text)
            away.set()
            writer.put(2)
            until(lambda: written == [2])
        finally:
            writer.close()
    assert tries.count([1]) == 1  # the error reply: one try only
    assert tries.count([2]) == 2  # the outage: tried again
    assert "Redis cannot take writes" in caplog.text
    assert "writing again after" in caplog.text


def test_close_writes_what_is_queued_and_refuses_more() -> None:
    written: list[int] = []
    gate = threading.Event()

    def write(items: list[int]) -> None:
        assert gate.wait(10)
        written.extend(items)

    writer = _writer(write)
    for n in range(5):
        writer.put(n)
    gate.set()
    assert writer.close()
    assert written == [0, 1, 2, 3, 4]
    assert not writer.put(5)
    assert writer._thread is not None and not writer._thread.is_alive()


def test_closing_during_an_outage_tries_once_more_then_drops(
    caplog: pytest.LogCaptureFixture,
) -> None:
    tries: list[list[int]] = []

    def write(items: list[int]) -> None:
        tries.append(list(items))
        raise RedisConnectionError("Redis went away")

    writer = _writer(write)
    writer._retry_s = 3600.0  # only the close ends the wait between tries
    with caplog.at_level(logging.WARNING, logger="worker.background"):
        writer.put(1)
        until(lambda: len(tries) == 1)
        writer.put(2)
        assert writer.close()
    assert tries == [[1], [1, 2]]
    assert "2 not written" in caplog.text and "dropped (covered elsewhere)" in caplog.text


def test_a_write_stuck_past_the_close_is_abandoned() -> None:
    """Nothing is written after ``close`` gave up waiting: a later write could land after the
    owner cleaned up what it writes to."""
    stuck, release = threading.Event(), threading.Event()
    written: list[list[int]] = []

    def write(items: list[int]) -> None:
        stuck.set()
        assert release.wait(10)
        written.append(list(items))

    writer = _writer(write)
    writer.put(1)
    assert stuck.wait(10)
    writer.put(2)
    assert not writer.close(timeout_s=0.0)
    release.set()
    assert writer._thread is not None
    writer._thread.join(10)
    assert written == [[1]]  # the write under way landed; the queued one was abandoned


def test_an_outage_that_outlasts_give_up_drops_the_batch_and_the_writer_goes_on(
    caplog: pytest.LogCaptureFixture,
) -> None:
    written: list[int] = []

    def write(items: list[int]) -> None:
        if 1 in items:
            raise RedisConnectionError("Redis went away")
        written.extend(items)

    writer = _writer(write, give_up_s=0.0)
    with caplog.at_level(logging.WARNING, logger="worker.background"):
        try:
            writer.put(1)
            until(lambda: "1 not written" in caplog.text)
            writer.put(2)
            until(lambda: written == [2])
        finally:
            writer.close()
