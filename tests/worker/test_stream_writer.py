"""The worker's stream writer against real Redis, with the one fault a retry cannot see
through: a script call that ran but whose reply never came back."""

from __future__ import annotations

from typing import Any

from redis import Redis
from redis.exceptions import ConnectionError as RedisConnectionError

from contracts.keys import stream_key
from tests.contracts.test_leases import TTL_S, _claim, _queued
from worker import streams
from worker.streams import DeltaPublisher


def test_a_batch_whose_reply_was_lost_is_not_written_twice(redis: Redis, monkeypatch: Any) -> None:
    monkeypatch.setattr(streams, "RETRY_S", 0.01)
    job = _queued(redis)
    _, running = _claim(redis, job, "w1:1:a")
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
        publisher.publish(job.id, running.attempts, "Hél")
        publisher.flush(job.id, running.attempts, timeout_s=10)
        publisher.publish(job.id, running.attempts, " wörld")
        publisher.flush(job.id, running.attempts, timeout_s=10)
        publisher.discard(job.id, running.attempts)  # it publishes no more
    finally:
        publisher.close()
    texts = [fields["text"] for _, fields in redis.xrange(stream_key(job.id))]  # type: ignore[union-attr]
    assert calls >= 3
    assert "".join(texts) == "Héllo wörld", texts
    assert not publisher._written  # nothing kept about a finished attempt
