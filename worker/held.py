"""The deliveries this worker holds, mirrored to Redis for the fleet's reapers.

A delivery is recorded as soon as the consumer receives it (``lorafleet:held:<worker>``,
broker delivery tag -> task id) and cleared once its outcome is stored; if this worker dies,
another worker's reaper hands everything recorded back to its queue (``worker.reaper``).
The writes happen on a thread of their own, in order and pipelined, so the consumer thread
never waits on Redis. A job's claim records its delivery as well, in the same script
(``contracts.job_records.CLAIM``), so a delivery that started running is always recorded;
what remains exposed is a delivery received and not yet claimed, for the few milliseconds
until the writer's next write (it gathers deliveries into one write), covered by the
visibility timeout.
"""

from __future__ import annotations

from redis import Redis

from contracts.keys import held_key
from worker.background import CoalescingWriter

_HOLD, _RELEASE = "hold", "release"
RETRY_S = 0.5
COALESCE_S = 0.005
"""How long the writer gathers deliveries before it writes them (the visibility timeout covers
a worker that dies meanwhile, as it covers the moment before any write). Under load
deliveries arrive one by one: gathering for a moment makes one write of many (a write per
delivery cost ~0.4 ms of CPU per job)."""


class HeldDeliveries:
    def __init__(self, redis: Redis, worker_id: str) -> None:
        self._redis = redis
        self._key = held_key(worker_id)
        # Kept in order and retried while Redis is away (the visibility timeout covers the
        # meantime); dropped only at shutdown, or if Redis refuses them as written.
        self._writer: CoalescingWriter[tuple[str, str, str]] = CoalescingWriter(
            "held-deliveries",
            self._write,
            coalesce_s=COALESCE_S,
            retry_s=RETRY_S,
            give_up_s=float("inf"),
            dropped="Redis's visibility timeout still restores a delivery this worker dies holding",
        )

    def start(self) -> None:
        self._writer.start()

    def close(self) -> None:
        self._writer.close()

    def received(self, delivery_tag: str, task_id: str) -> None:
        """Called on the consumer thread as a message arrives: never blocks."""
        self._writer.put((_HOLD, delivery_tag, task_id))

    def finished(self, delivery_tag: str) -> None:
        """The outcome is stored (or the delivery handed back): nothing left to restore.

        By delivery, not by job: a duplicate delivery of a job this worker also runs stays
        recorded until it, too, is finished."""
        self._writer.put((_RELEASE, delivery_tag, ""))

    def _write(self, ops: list[tuple[str, str, str]]) -> None:
        pipe = self._redis.pipeline(transaction=False)
        for op, tag, task_id in ops:
            if op == _HOLD:
                pipe.hset(self._key, tag, task_id)
            else:
                pipe.hdel(self._key, tag)
        pipe.execute()
