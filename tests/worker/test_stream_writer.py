"""The worker's stream writer against real Redis, with the one fault a retry cannot see
through: a script call that ran but whose reply never came back."""

from __future__ import annotations

import threading
import time
from typing import Any

import pytest
from redis import Redis
from redis.exceptions import ConnectionError as RedisConnectionError

from contracts.jobs import JobPublic
from contracts.keys import DEADLINES, stream_key
from tests.contracts.test_leases import TTL_S, _claim, _queued
from worker import streams
from worker.streams import DeltaPublisher


def _running(redis: Redis, request: pytest.FixtureRequest) -> tuple[JobPublic, JobPublic]:
    """A job claimed by ``w1:1:a``, due in an hour: the session's deadline sweeper (running
    once the stack has started) leaves it alone, and it leaves the index after the test."""
    job = _queued(redis)
    redis.zadd(DEADLINES, {job.id: time.time() + 3600})
    request.addfinalizer(lambda: redis.zrem(DEADLINES, job.id))
    _, running = _claim(redis, job, "w1:1:a")
    return job, running


def test_a_batch_whose_reply_was_lost_is_not_written_twice(
    redis: Redis, monkeypatch: Any, request: pytest.FixtureRequest
) -> None:
    monkeypatch.setattr(streams, "RETRY_S", 0.01)
    job, running = _running(redis, request)
    publisher = DeltaPublisher(redis, "w1:1:a", TTL_S)
    real = publisher._append
    calls = 0

    def reply_lost_once(keys: list[str], args: list[Any]) -> Any:
        nonlocal calls
        calls += 1
        answer = real(keys=keys, args=args)  # the script ran
        if calls == 1:
            publisher.publish(job.id, running.attempts, "lo")  # more text meanwhile
            raise RedisConnectionError("Connection closed by server.")  # the reply was lost
        return answer

    publisher._append = reply_lost_once  # type: ignore[method-assign]
    publisher.start()
    try:
        publisher.open(job.id, running.attempts)
        publisher.publish(job.id, running.attempts, "Hél")
        publisher.flush(job.id, running.attempts, timeout_s=10)
        publisher.publish(job.id, running.attempts, " wörld")
        publisher.flush(job.id, running.attempts, timeout_s=10)
        publisher.finish(job.id, running.attempts)  # it publishes no more
    finally:
        publisher.close()
    texts = [fields["text"] for _, fields in redis.xrange(stream_key(job.id))]  # type: ignore[union-attr]
    assert calls >= 3
    assert "".join(texts) == "Héllo wörld", texts
    assert not publisher._written  # nothing kept about a finished attempt


def test_text_published_after_the_attempt_was_discarded_is_dropped(
    redis: Redis, request: pytest.FixtureRequest
) -> None:
    """A stopped job's task on the engine loop can hand over one more delta after the job
    thread discarded the attempt: it must not be written (at offset 0 it would have been cut
    against the text already in the stream), and nothing is kept about the attempt."""
    job, running = _running(redis, request)
    publisher = DeltaPublisher(redis, "w1:1:a", TTL_S)
    publisher.start()
    try:
        publisher.open(job.id, running.attempts)
        publisher.publish(job.id, running.attempts, "Hi")
        publisher.flush(job.id, running.attempts, timeout_s=10)
        publisher.discard(job.id, running.attempts)  # the job was stopped
        publisher.publish(job.id, running.attempts, " there")  # late, from the engine loop
        publisher.flush(job.id, running.attempts, timeout_s=10)
    finally:
        publisher.close()
    texts = [fields["text"] for _, fields in redis.xrange(stream_key(job.id))]  # type: ignore[union-attr]
    assert texts == ["Hi"]
    assert not publisher._written and not publisher._pending


def test_an_attempt_finished_with_text_still_pending_is_written_then_forgotten(
    redis: Redis, monkeypatch: Any, request: pytest.FixtureRequest
) -> None:
    """Redis did not take the text before the flush gave up: the attempt is finished, its
    text is still written once Redis answers, and then nothing is kept about it."""
    monkeypatch.setattr(streams, "RETRY_S", 0.01)
    job, running = _running(redis, request)
    publisher = DeltaPublisher(redis, "w1:1:a", TTL_S)
    real = publisher._append
    outage = True

    def down_until_told(keys: list[str], args: list[Any]) -> Any:
        if outage:
            raise RedisConnectionError("Connection refused.")
        return real(keys=keys, args=args)

    publisher._append = down_until_told  # type: ignore[method-assign]
    publisher.start()
    try:
        publisher.open(job.id, running.attempts)
        publisher.publish(job.id, running.attempts, "late but whole")
        with pytest.raises(TimeoutError):
            publisher.flush(job.id, running.attempts, timeout_s=0.2)
        publisher.finish(job.id, running.attempts)
        outage = False
        deadline = time.monotonic() + 10  # nobody flushes a finished attempt: wait for it
        while publisher._written:
            assert time.monotonic() < deadline, "the finished attempt's text was never written"
            time.sleep(0.01)
    finally:
        publisher.close()
    texts = [fields["text"] for _, fields in redis.xrange(stream_key(job.id))]  # type: ignore[union-attr]
    assert texts == ["late but whole"]
    assert not publisher._written and not publisher._closing


def test_a_delta_wakes_no_thread_waiting_at_its_flush() -> None:
    """Jobs that finished generating wait at their flush while the others still stream: with
    hundreds of each, a delta that woke every waiting thread (each wakeup takes the GIL from
    the engine loop) cost a step's worth of wakeups per delta. Only the end of a write may
    wake a flush; the writer is woken when text arrives and none was pending."""
    waiting: list[str] = []  # every wait, by thread name
    notified: list[tuple[int, frozenset[str]]] = []  # every notify: by whom, whom it may wake

    class Counted(threading.Condition):
        """Records its waiters by name, and who notified while which of them waited (both
        with its lock held)."""

        def __init__(self, lock: Any) -> None:
            super().__init__(lock)
            self.names: set[str] = set()

        def wait(self, timeout: float | None = None) -> bool:
            name = threading.current_thread().name
            waiting.append(name)
            self.names.add(name)
            try:
                return super().wait(timeout)
            finally:
                self.names.discard(name)

        def notify(self, n: int = 1) -> None:  # ``notify_all`` calls it too
            notified.append((threading.get_ident(), frozenset(self.names)))
            super().notify(n)

    publisher = DeltaPublisher(Redis(), "w1:1:a", TTL_S)  # its script is replaced: no Redis
    for name, value in list(vars(publisher).items()):  # its conditions, whatever they are
        if isinstance(value, threading.Condition):
            setattr(publisher, name, Counted(value._lock))  # type: ignore[attr-defined]
    write_may_end = threading.Event()
    batches: list[list[Any]] = []

    def held_write(keys: list[str], args: list[Any]) -> list[int]:
        batches.append(args)
        assert write_may_end.wait(10), "the test never let the write end"
        return []  # nothing refused

    publisher._append = held_write  # type: ignore[method-assign]
    publisher.start()
    flushers = 8
    failures: list[BaseException] = []

    def flush(job_id: str) -> None:
        try:
            publisher.flush(job_id, 1, timeout_s=10)
        except BaseException as exc:  # reported by the test thread
            failures.append(exc)

    threads = [
        threading.Thread(target=flush, args=(f"done-{i}",), name=f"flush-{i}")
        for i in range(flushers)
    ]
    try:
        for i in range(flushers):
            publisher.open(f"done-{i}", 1)
            publisher.publish(f"done-{i}", 1, "the whole text")
        publisher.open("streaming", 1)
        deadline = time.monotonic() + 10
        while not batches:  # the writer holds the finished jobs' text in its write
            assert time.monotonic() < deadline, "the writer never took the text"
            time.sleep(0.01)
        for thread in threads:
            thread.start()
        while sum(1 for name in waiting if name.startswith("flush-")) < flushers:
            assert time.monotonic() < deadline, "the flushes never waited"
            time.sleep(0.01)
        before = len(notified)
        for step in range(200):  # a job still streaming, one delta a step
            publisher.publish("streaming", 1, f"token {step} ")
        me = threading.get_ident()
        by_deltas = [names for who, names in notified[before:] if who == me]
        woke_flushes = [names for names in by_deltas if any(n.startswith("flush-") for n in names)]
        assert woke_flushes == [], f"{len(woke_flushes)} of 200 deltas could wake the flushes"
        assert len(by_deltas) <= 1, f"200 deltas notified {len(by_deltas)} times"
        write_may_end.set()
        for thread in threads:
            thread.join(10)
        assert not failures, failures
        assert not any(thread.is_alive() for thread in threads)
    finally:
        write_may_end.set()
        publisher.close()
    assert len(batches) == 2  # the text of the finished jobs, then the one still streaming


@pytest.mark.parametrize("write", ["failed", "refused"])
def test_an_attempt_discarded_while_its_text_was_written_leaves_nothing_behind(
    monkeypatch: Any, write: str
) -> None:
    """The job was stopped (its attempt discarded) while the writer was writing its text, and
    that write failed (Redis went away) or was refused (the stopped attempt's lease was gone):
    no later write carries it (a retry wrote it from offset 0, not where its text ended), and
    nothing is kept about it (a refusal nobody will flush stayed in the fenced set for good)."""
    monkeypatch.setattr(streams, "RETRY_S", 0.01)
    publisher = DeltaPublisher(Redis(), "w1:1:a", TTL_S)  # its script is replaced: no Redis
    written: list[list[Any]] = []

    def outage_while_discarded(keys: list[str], args: list[Any]) -> list[int]:
        if not written:
            written.append([])  # the first call: the job is stopped meanwhile
            publisher.discard("stopped", 1)
            if write == "failed":
                raise RedisConnectionError("Connection refused.")
            return [1]  # the batch's first attempt refused: the stopped one, alone in it
        written.append(keys)
        return []

    publisher._append = outage_while_discarded  # type: ignore[method-assign]
    publisher.open("stopped", 1)
    publisher.open("running", 1)
    publisher.publish("stopped", 1, "text of a stopped job")
    publisher.start()
    try:
        deadline = time.monotonic() + 10
        while len(written) < 2:  # the first call, then a write of what is still wanted
            publisher.publish("running", 1, ".")
            publisher.flush("running", 1, timeout_s=10)
            assert time.monotonic() < deadline, "the writer never wrote again"
    finally:
        publisher.close()
    retried = [key for call in written[1:] for key in call]
    assert not any("stopped" in key for key in retried), retried
    assert ("stopped", 1) not in publisher._fenced | publisher._written.keys()
