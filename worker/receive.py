"""Receipt in batches: after a ``BRPOP``, one script records it and takes the queue's next few.

kombu's Redis transport receives one message per ``BRPOP`` and then records it as
unacknowledged (``unacked`` hash and ``unacked_index`` sorted set) in a ``MULTI`` of its own
(``QoS.append``): two round trips and an event-loop turn per message in the worker's one
consumer thread, before Celery's own dispatch. Here the ``BRPOP``'s message is recorded by a
script that, in the same call, pops further messages from the same list, up to the
consumer's free prefetch and ``LORAFLEET_RECEIVE_BATCH`` in all, and records each as
kombu would, in kombu's own format (``[payload, exchange, routing key]`` under the delivery
tag, scored by the time of receipt). So a burst of ``n`` messages costs one ``BRPOP`` and one
script instead of ``n`` of each, and the extra messages are never off the list unrecorded
(kombu pops and records in two steps; the first message of a batch still has that window, as
with kombu alone). Everything that reads those records is unchanged: kombu's acks, its
visibility-timeout restore and its restore of unstarted messages at shutdown, and
``worker.reaper``, which restores a dead worker's deliveries by tag. (One change to kombu's
ack, batched or not: a delivery whose job another attempt took over is only forgotten here,
its record left to the worker that holds it now, ``taken_over``.)

The prefetch limit holds: a batch takes no more than the QoS allows
(``can_consume_max_estimate``), so ``worker_prefetch_multiplier`` still bounds what a worker
holds. A batch comes from one list: with several queues, kombu's rotation between them moves
on per batch, not per message. And a small burst goes mostly to the first idle worker to read
it, where one at a time spreads it over the idle workers ``BRPOP``ing the queue;
``LORAFLEET_RECEIVE_BATCH=1`` reads as kombu does.

Acks are batched too. kombu acks each job with a ``MULTI`` (``ZREM`` and ``HDEL`` of its
record) from the job's own pool thread as it finishes; here an ack is handed to a writer thread
that gathers the acks arriving within a few milliseconds (``ACK_COALESCE_S``) and removes all
their records in one ``MULTI`` (``worker.background.CoalescingWriter``). An ack written late is
only a message that stays recorded a little longer: if the worker dies first, the visibility
timeout hands it back (the reaper only if the worker's own record of the delivery, released
just before the ack, was not written either), and the job's record makes the second delivery
a no-op, as for any duplicate. Closing the channel writes the pending acks first (one more
try if Redis refuses, at most 5 s) before kombu puts back what was received and not
acknowledged; acks Redis could not take for ``ACK_GIVE_UP_S``, or at that last try, are left
to the visibility timeout rather than retried for ever.

kombu's ``_brpop_read`` is replaced (``BatchedChannel``, written against kombu 5.7); with a
``global_keyprefix`` or a batch of 1 the channel reads as kombu does. The worker uses this
transport for ``redis://`` and ``rediss://`` brokers while ``LORAFLEET_RECEIVE_BATCH`` is
above 1 (16 by default).
"""

from __future__ import annotations

import functools
import logging
import threading
import time
from queue import Empty
from typing import Any, cast

from kombu.transport import redis as kombu_redis
from kombu.transport.virtual import QoS as VirtualQoS
from kombu.utils.encoding import bytes_to_str
from kombu.utils.json import dumps, loads

from worker.background import CoalescingWriter
from worker.config import WorkerSettings

log = logging.getLogger(__name__)

RECEIVE_BATCH = cast(int, WorkerSettings.model_fields["receive_batch"].default)
"""At most this many messages are taken from one list in one receipt (the ``BRPOP``'s and up to
``RECEIVE_BATCH - 1`` more), unless the transport option ``receive_batch`` says otherwise (the
worker always passes ``LORAFLEET_RECEIVE_BATCH``, whose default this is)."""

ACK_COALESCE_S = 0.005
"""How long the ack writer gathers acks before it writes them (a job that finished is only
recorded as unacknowledged that much longer)."""
ACK_RETRY_S = 0.5
"""How often acks Redis could not take are tried again."""
ACK_GIVE_UP_S = 30.0
"""Acks Redis could not take for this long are dropped: the visibility timeout returns their
messages, as duplicates of deliveries this worker is done with (a finished job's record makes
its duplicate a no-op), as it would after a crash."""

RECEIVE = """
-- KEYS[1] the list the BRPOP answered from, KEYS[2] kombu's unacked index, KEYS[3] its unacked
-- hash. ARGV[1] the time of receipt, ARGV[2] how many more to take, ARGV[3] and ARGV[4] the
-- BRPOP's message's delivery tag and its record. Returns each message taken and its tag.
redis.call('ZADD', KEYS[2], ARGV[1], ARGV[3])
redis.call('HSET', KEYS[3], ARGV[3], ARGV[4])
local taken = {}
for _ = 1, tonumber(ARGV[2]) do
  local item = redis.call('RPOP', KEYS[1])
  if not item then break end
  local ok, message = pcall(cjson.decode, item)
  local props = ok and type(message) == 'table' and message['properties']
  local tag = type(props) == 'table' and props['delivery_tag']
  local info = type(props) == 'table' and props['delivery_info']
  if type(tag) ~= 'string' or type(info) ~= 'table'
      or type(info['exchange']) ~= 'string' or type(info['routing_key']) ~= 'string' then
    -- Not a message this script can record: back where it was, for kombu's own read.
    redis.call('RPUSH', KEYS[1], item)
    break
  end
  redis.call('ZADD', KEYS[2], ARGV[1], tag)
  redis.call('HSET', KEYS[3], tag,
    '[' .. item .. ',' .. cjson.encode(info['exchange']) .. ','
    .. cjson.encode(info['routing_key']) .. ']')
  taken[#taken + 1] = item
  taken[#taken + 1] = tag
end
return taken
"""


_taken_over: set[str] = set()
_taken_over_lock = threading.Lock()


def taken_over(delivery_tag: str) -> None:
    """The job of ``delivery_tag`` is another attempt's now: acking it must leave the broker's
    record of the delivery alone.

    A worker that stalls past its heartbeat and its job's lease has its delivery handed back
    (by a reaper, or the visibility timeout) and received again by another worker, which
    records it under the same delivery tag (the tag travels with the message) and claims the
    job. When the stalled attempt wakes and ends without an outcome, its ack would remove
    that record: the new holder's, and if the new holder then died nothing would be left to
    hand back (the job would wait for its deadline). Called before the task returns; its ack
    then only forgets the delivery in this process."""
    with _taken_over_lock:
        _taken_over.add(delivery_tag)


def is_taken_over(delivery_tag: str, forget: bool = False) -> bool:
    """Whether ``delivery_tag`` was marked ``taken_over`` and not acknowledged since
    (``forget``: and unmark it, as its ack does)."""
    with _taken_over_lock:
        if delivery_tag not in _taken_over:
            return False
        if forget:
            _taken_over.discard(delivery_tag)
        return True


def _unless_taken_over(ack: Any) -> Any:
    """kombu's Redis ``QoS.ack``, which forgets the delivery here only for a delivery
    ``taken_over`` (installed for every kombu Redis channel of the worker, batched or not)."""

    @functools.wraps(ack)
    def _ack(self: Any, delivery_tag: str) -> None:
        if is_taken_over(delivery_tag, forget=True):
            log.info("delivery %s: its record is another worker's now; left in place", delivery_tag)
            VirtualQoS.ack(self, delivery_tag)
            return
        ack(self, delivery_tag)

    return _ack


kombu_redis.QoS.ack = _unless_taken_over(kombu_redis.QoS.ack)  # type: ignore[method-assign]


def unacked_record(payload: dict[str, Any]) -> str:
    """What kombu's ``QoS.append`` stores under a delivery tag: ``[payload, exchange, key]``."""
    info = payload["properties"]["delivery_info"]
    return str(dumps([payload, info["exchange"], info["routing_key"]]))


class BatchedQoS(kombu_redis.QoS):
    """kombu's QoS, except that a message the receipt script already recorded is only
    remembered as delivered (no second ``MULTI``), and acks are written in batches (a
    ``CoalescingWriter``) while the channel receives in batches."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.recorded: set[str] = set()
        self.acks: CoalescingWriter[str] = CoalescingWriter(
            f"acks-{id(self):x}",
            self._write_acks,
            coalesce_s=ACK_COALESCE_S,
            retry_s=ACK_RETRY_S,
            give_up_s=ACK_GIVE_UP_S,
            dropped="their messages stay recorded until the visibility timeout returns them, "
            "as duplicates of deliveries this worker is done with",
        )

    def ack(self, delivery_tag: str) -> None:
        if (
            not self.channel._kombus_read()
            and not is_taken_over(delivery_tag)
            and self.acks.put(delivery_tag)
        ):
            VirtualQoS.ack(self, delivery_tag)
        else:
            super().ack(delivery_tag)  # kombu's (which leaves a record taken over in place)

    def _write_acks(self, tags: list[str]) -> None:
        """One ``MULTI`` removing the records of all ``tags`` (kombu's ack, for many)."""
        with self.channel.conn_or_acquire() as client:
            pipe = client.pipeline()
            pipe.zrem(self.unacked_index_key, *tags).hdel(self.unacked_key, *tags).execute()

    def append(self, message: Any, delivery_tag: str) -> None:
        if delivery_tag in self.recorded:
            self.recorded.discard(delivery_tag)
            VirtualQoS.append(self, message, delivery_tag)
        else:
            super().append(message, delivery_tag)


class BatchedChannel(kombu_redis.Channel):
    QoS = BatchedQoS

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self._receive_script: Any = None
        self._no_ack_queues: set[str] = set()
        options = self.connection.client.transport_options or {}
        self._batch = max(1, int(options.get("receive_batch", RECEIVE_BATCH)))

    def basic_consume(self, queue: str, no_ack: bool, *args: Any, **kwargs: Any) -> Any:
        # kombu records nothing for a no-ack consumer (``virtual.Channel.basic_consume``):
        # while this channel has one, it reads as kombu does.
        if no_ack:
            self._no_ack_queues.add(queue)
        return super().basic_consume(queue, no_ack, *args, **kwargs)

    def close(self) -> None:
        # The pending acks first: kombu then restores what was delivered and not acked.
        qos = self._qos
        if isinstance(qos, BatchedQoS):
            qos.acks.close()
        super().close()

    def _kombus_read(self) -> bool:
        return bool(
            self._batch == 1
            or self.global_keyprefix
            or self._no_ack_queues
            or not isinstance(self.qos, BatchedQoS)
        )

    def _brpop_read(self, **options: Any) -> bool:
        if self._kombus_read():
            return bool(super()._brpop_read(**options))
        try:
            try:
                key__item = self.client.parse_response(self.client.connection, "BRPOP", **options)
            except self.connection_errors:
                # As kombu: the next iteration reconnects.
                self.client.connection.disconnect()
                raise
            if not key__item:
                raise Empty()
            key, item = key__item
            key = bytes_to_str(key)
            dest = key.rsplit(self.sep, 1)[0]
            self._queue_cycle.rotate(dest)
            payload = loads(bytes_to_str(item))
            tag = str(payload["properties"]["delivery_tag"])
            # No consumer for the queue any more (cancelled while the BRPOP was out, or the
            # channel closing): take nothing more than kombu would.
            wanted = dest in self.connection._callbacks and not self._closing
            taken = self._record_and_take(key, payload, tag, wanted)
            self._hand_over(payload, tag, taken, dest)
            return True
        finally:
            self._in_poll = None  # type: ignore[assignment]
            flush = getattr(self, "_flush_brpop_reauth", None)
            if flush is not None:
                flush()

    def _record_and_take(
        self, key: str, payload: dict[str, Any], tag: str, wanted: bool
    ) -> list[tuple[str, Any]]:
        """Record the ``BRPOP``'s message (delivery tag ``tag``) as unacknowledged and pop
        and record up to the free prefetch more from ``key`` (none if not ``wanted``), in one
        script; the popped messages as (delivery tag, raw message), oldest first."""
        qos = self.qos
        free = qos.can_consume_max_estimate()
        # The BRPOP's message is not appended yet: it takes one of the free places.
        more = self._batch - 1 if free is None else max(0, min(self._batch, free) - 1)
        with self.conn_or_acquire() as client:
            if self._receive_script is None:
                self._receive_script = client.register_script(RECEIVE)
            flat = self._receive_script(
                keys=[key, self.unacked_index_key, self.unacked_key],
                args=[time.time(), more if wanted else 0, tag, unacked_record(payload)],
                client=client,
            )
        taken = [(bytes_to_str(flat[i + 1]), flat[i]) for i in range(0, len(flat), 2)]
        qos.recorded.add(tag)
        qos.recorded.update(t for t, _ in taken)
        return taken

    def _hand_over(
        self, payload: dict[str, Any], tag: str, taken: list[tuple[str, Any]], dest: str
    ) -> None:
        """Hand the messages of one read (the ``BRPOP``'s, delivery tag ``tag``, then those
        ``taken``) to their consumer. Whatever was recorded and not handed over (the consumer
        or a message's decoding failed half-way) goes back to the head of its queue at once:
        recorded but undelivered, it would otherwise wait for the visibility timeout (neither
        the restore at shutdown nor a reaper knows it)."""
        tags = [tag, *(t for t, _ in taken)]
        try:
            self.connection._deliver(payload, dest)
            for _, raw in taken:
                self.connection._deliver(loads(bytes_to_str(raw)), dest)
        finally:
            # Newest first: each goes back to the end the queue is read from.
            for back in reversed(tags):
                if back in self.qos.recorded:
                    self.qos.recorded.discard(back)
                    try:
                        self.qos.restore_by_tag(back)
                    except Exception:
                        log.warning("could not hand delivery %s back; its record stays", back)


class Transport(kombu_redis.Transport):
    """kombu's Redis transport with batched receipt (``redis://`` in the worker process)."""

    Channel = BatchedChannel
