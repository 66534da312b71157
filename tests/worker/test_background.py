"""``worker.background.CoalescingWriter``: what it retries, what it drops, and closing."""

from __future__ import annotations

import logging
import threading

import pytest
from redis.exceptions import ConnectionError as RedisConnectionError
from redis.exceptions import ResponseError

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


def test_an_error_reply_is_dropped_at_once_and_an_outage_is_retried(
    caplog: pytest.LogCaptureFixture,
) -> None:
    """Redis refusing a write as written would refuse it again: dropped, not retried. Redis
    away: the same items are written once it answers, in order, with what came meanwhile."""
    tries: list[list[int]] = []
    written: list[int] = []
    away = threading.Event()

    def write(items: list[int]) -> None:
        tries.append(list(items))
        if items[0] == 1:
            raise ResponseError("WRONGTYPE")
        if away.is_set():
            away.clear()
            raise RedisConnectionError("Redis went away")
        written.extend(items)

    writer = _writer(write)
    with caplog.at_level(logging.WARNING, logger="worker.background"):
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
    assert "Redis unreachable" in caplog.text


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
    writer.close()
    assert written == [0, 1, 2, 3, 4]
    assert not writer.put(5)


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
