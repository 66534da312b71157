"""Hands a dead worker's jobs back to their queues, without waiting for the visibility timeout.

Every worker records the deliveries it has received and not yet finished (``held_key``:
broker delivery tag -> task id) and refreshes a heartbeat key that expires ``announcement_ttl_s``
after its last beat. Every ``restore_interval_s`` each worker looks for workers in the index
whose heartbeat expired; for each delivery such a worker held, the first reaper to remove the
entry puts the message back on its queue with kombu's own restore (the message moves from the
transport's unacked set to the queue, as a visibility-timeout restore would do). So a job
killed with its worker runs again within about ``announcement_ttl_s + restore_interval_s``,
long before its deadline, while the visibility timeout remains the backstop (for example for a
reaper that died half-way).

A worker id carries a boot id (``host:pid:boot``): a container restarted in the same pod runs
as the same pid on the same host, and without it the new process would take its dead
predecessor's deliveries for its own. With it, the new process knows at its first sweep that
its predecessor is gone (the pid is its own now) and restores its deliveries at once, without
waiting for the predecessor's heartbeat to expire. (So two live workers must never share a
hostname and a pid: give every container its own hostname, as Kubernetes and Compose do.)

A worker that looks dead but is not (its heartbeat expired during a Redis outage) loses
nothing: a restored job waits for the lease of the attempt still running it
(``contracts.job_records.CLAIM``).
"""

from __future__ import annotations

import json
import logging
import time

from kombu import Connection
from redis import Redis

from contracts import routing
from contracts.keys import (
    WORKER_QUEUES,
    WORKERS_INDEX,
    held_key,
    job_key,
    routed_key,
    worker_key,
)
from contracts.queues import UNROUTABLE_QUEUE
from contracts.task_messages import accepted_at
from worker.background import Periodic

log = logging.getLogger(__name__)


class Reaper(Periodic):
    def __init__(self, redis: Redis, broker_url: str, worker_id: str, interval_s: float) -> None:
        self._redis = redis
        self._broker_url = broker_url
        self._worker_id = worker_id
        super().__init__("reaper", interval_s)

    def step(self) -> int:
        return self.sweep()

    def sweep(self) -> int:
        """Restore the held deliveries of every worker that is gone: its heartbeat expired,
        or it was this process's predecessor (same host, same pid, another boot)."""
        restored = 0
        for member in self._redis.smembers(WORKERS_INDEX):  # type: ignore[union-attr]
            other = str(member)
            if other == self._worker_id:
                continue
            if _host_pid(other) == _host_pid(self._worker_id):
                # This pid is ours now: the process that announced it died (a container
                # restarted in its pod). No need to wait for its heartbeat to expire.
                self._redis.delete(worker_key(other))
            elif self._redis.exists(worker_key(other)):
                continue
            restored += self._reap(other)
        return restored

    def _reap(self, dead: str) -> int:
        held: dict[str, str] = self._redis.hgetall(held_key(dead))  # type: ignore[assignment]
        restored = 0
        if held:
            with Connection(self._broker_url) as connection:
                qos = connection.default_channel.qos
                for tag in held:
                    # Whoever removes the entry restores it: two reapers never both do.
                    if self._redis.hdel(held_key(dead), tag) == 1:
                        qos.restore_by_tag(tag)
                        restored += 1
            log.warning("worker %s is gone: %d job(s) back on their queues", dead, restored)
        if not self._redis.exists(held_key(dead)):
            self._redis.srem(WORKERS_INDEX, dead)
        return restored


def _host_pid(worker_id: str) -> str | None:
    """``host:pid`` of a ``host:pid:boot`` worker id (``None`` for an id without a boot)."""
    host, pid, *boot = worker_id.split(":")
    return f"{host}:{pid}" if boot else None


QUEUE_FORGET_S = 120.0
"""A gone worker's own queue is forgotten this long after it last announced itself serving
(and only once empty): far longer than a gateway routes on an old view of the fleet
(``LORAFLEET_ROUTE_VIEW_MAX_AGE_S``), so no routed job arrives after it is forgotten."""

FORGET_IF_EMPTY = """
if redis.call('LLEN', KEYS[2]) == 0 then return redis.call('ZREM', KEYS[1], ARGV[1]) end
return 0
"""


def hand_back(redis: Redis, worker_id: str, limit: int = 0) -> int:
    """Move the ``limit`` oldest jobs (0: all) of ``worker_id``'s own queue back to their
    pool queues, in one script; how many moved."""
    moved = redis.register_script(routing.HANDBACK)(
        keys=[routing.worker_queue(worker_id), routed_key(worker_id)],
        args=routing.handback_args(limit, UNROUTABLE_QUEUE),
    )
    return int(moved)


def recover(redis: Redis, worker_id: str) -> int:
    """For a worker that is gone, after its queue was handed back: push again the message of
    every job routed to it that no worker received (``routing.RECOVER``); how many."""
    fallback, prefix, worker_prefix = routing.handback_args(0, UNROUTABLE_QUEUE)[1:]
    pushed = redis.register_script(routing.RECOVER)(
        keys=[routed_key(worker_id)], args=[job_key(""), fallback, prefix, worker_prefix]
    )
    return int(pushed)


class QueueKeeper(Periodic):
    """No routed job is stranded in a worker's own queue (``contracts.routing``): every
    worker, every ``interval_s``, hands back to the shared queues everything waiting in the
    queue of a worker that is gone, draining or failed, and the jobs that have waited longer
    than ``max_wait_s`` since admission in the queue of a serving one (it stopped consuming,
    or is slower than the gateway thought). Several workers doing this at once is harmless:
    each move is one script, so a job is in one queue or the other."""

    def __init__(self, redis: Redis, interval_s: float, max_wait_s: float) -> None:
        self._redis = redis
        self._max_wait_s = max_wait_s
        super().__init__("queue-keeper", interval_s)

    def step(self) -> int:
        return self.sweep()

    def sweep(self) -> int:
        now = time.time()
        watched: list[tuple[str, float]] = self._redis.zrange(  # type: ignore[assignment]
            WORKER_QUEUES, 0, -1, withscores=True
        )
        if not watched:
            return 0
        # Only queues with something in them, a routed index, or long gone need a look (and
        # their worker's record): one small round trip for the rest of the fleet.
        pipe = self._redis.pipeline(transaction=False)
        for worker_id, _ in watched:
            pipe.llen(routing.worker_queue(worker_id))
            pipe.exists(routed_key(worker_id))
        counts = pipe.execute()
        looked = [
            (worker_id, seen)
            for (worker_id, seen), waiting, indexed in zip(
                watched, counts[::2], counts[1::2], strict=True
            )
            if waiting or indexed or float(seen) < now - QUEUE_FORGET_S
        ]
        if not looked:
            return 0
        records = self._redis.mget([worker_key(worker_id) for worker_id, _ in looked])
        moved = 0
        for (worker_id, seen), raw in zip(looked, records, strict=True):  # type: ignore[arg-type]
            state = json.loads(raw).get("state") if raw is not None else None
            if state != "serving":
                handed = hand_back(self._redis, worker_id)
                if raw is None:
                    recovered = recover(self._redis, worker_id)
                    if recovered:
                        log.warning(
                            "worker %s is gone: %d routed job(s) it may have taken with it "
                            "(received by nobody) pushed again",
                            worker_id,
                            recovered,
                        )
                    handed += recovered
                if handed:
                    log.warning(
                        "worker %s is %s: %d routed job(s) back to the shared queues",
                        worker_id,
                        state or "gone",
                        handed,
                    )
                moved += handed
                if raw is None and float(seen) < now - QUEUE_FORGET_S:
                    self._redis.eval(
                        FORGET_IF_EMPTY,
                        2,
                        WORKER_QUEUES,
                        routing.worker_queue(worker_id),
                        worker_id,
                    )
            else:
                moved += self._expire(worker_id, now)
        return moved

    def _expire(self, worker_id: str, now: float) -> int:
        """Hand back the jobs of a serving worker's queue admitted over ``max_wait_s`` ago."""
        queue = routing.worker_queue(worker_id)
        oldest = self._redis.lindex(queue, -1)  # kombu pushes left and pops right
        if oldest is None:
            return 0
        cutoff = now - self._max_wait_s
        accepted = accepted_at(oldest)  # type: ignore[arg-type]
        if accepted is not None and accepted > cutoff:
            return 0
        waiting = self._redis.lrange(queue, 0, -1)
        stale = sum(
            1
            for raw in waiting  # type: ignore[union-attr]
            if (when := accepted_at(raw)) is None or when <= cutoff
        )
        handed = hand_back(self._redis, worker_id, max(stale, 1))
        if handed:
            log.warning(
                "%d routed job(s) waited over %.0f s in the queue of worker %s: back to the "
                "shared queues",
                handed,
                self._max_wait_s,
                worker_id,
            )
        return handed
