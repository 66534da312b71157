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

import logging

from kombu import Connection
from redis import Redis

from contracts.keys import WORKERS_INDEX, held_key, worker_key
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
