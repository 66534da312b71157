"""Held deliveries are mirrored to Redis in order, off the caller's thread."""

from __future__ import annotations

import uuid

from redis import Redis

from contracts.keys import held_key
from tests.helpers import until
from worker.held import HeldDeliveries


def test_received_then_finished_is_written_in_order(redis: Redis) -> None:
    worker = f"test:{uuid.uuid4().hex[:6]}"
    held = HeldDeliveries(redis, worker)
    held.start()
    try:
        for n in range(50):
            held.received(f"tag-{n}", f"task-{n}")
        for n in range(0, 50, 2):
            held.finished(f"tag-{n}")
        # Written in order: only the end has 25 entries and tag-0's release done.
        key = held_key(worker)
        until(lambda: redis.hlen(key) == 25 and not redis.hexists(key, "tag-0"))
        assert redis.hget(held_key(worker), "tag-1") == "task-1"
        assert redis.hget(held_key(worker), "tag-0") is None
        # A job received and finished at once leaves nothing behind, whatever the batching.
        held.received("tag-q", "quick")
        held.finished("tag-q")
        # Two deliveries of one job are two entries: finishing one keeps the other.
        held.received("tag-a", "twice")
        held.received("tag-b", "twice")
        held.finished("tag-a")
    finally:
        held.close()
    assert not redis.hexists(held_key(worker), "tag-q")
    assert redis.hget(held_key(worker), "tag-b") == "twice"
    assert redis.hlen(held_key(worker)) == 26
    redis.delete(held_key(worker))
