"""Batched receipt (``worker.receive``) against a real Redis: one read takes up to the free
prefetch, records each message as kombu itself would, and whatever reads kombu's records
(its acks, its restore by tag, as ``worker.reaper`` uses it) works on them unchanged."""

from __future__ import annotations

import json
import logging
import os
import subprocess
import sys
import threading
import uuid
from collections.abc import Callable, Iterator
from typing import Any

import pytest
from kombu import Connection, Consumer, Queue
from kombu.message import Message
from kombu.transport import redis as kombu_redis
from redis import Redis
from redis.exceptions import ConnectionError as RedisConnectionError

from contracts.task_messages import task_message
from tests.conftest import LocalStack
from tests.helpers import until
from worker import receive
from worker.receive import RECEIVE_BATCH, Transport

UNACKED, UNACKED_INDEX = "unacked", "unacked_index"


@pytest.fixture
def queue(redis: Redis) -> Iterator[str]:
    name = f"receive-test-{uuid.uuid4().hex[:8]}"
    yield name
    tags = [t for t, record in redis.hgetall(UNACKED).items() if name in record]  # type: ignore[union-attr]
    if tags:
        redis.hdel(UNACKED, *tags)
        redis.zrem(UNACKED_INDEX, *tags)
    redis.delete(name)


def _push(redis: Redis, queue: str, n: int) -> list[str]:
    """``n`` job messages onto ``queue`` as the gateway's admission pushes them; their raw JSON,
    oldest first."""
    raws = [
        task_message("lorafleet.run_job", f"job-{i}", queue, [{"job_id": f"job-{i}"}], f"job {i}")
        for i in range(n)
    ]
    for raw in raws:
        redis.lpush(queue, raw)
    return raws


def _consumer(
    url: str,
    queue: str,
    prefetch: int,
    on_message: Callable[[Message], None] | None = None,
    options: dict[str, int] | None = None,
    transport: Any = Transport,
) -> tuple[Connection, list[Message]]:
    """A batched consumer (or one of ``transport``) of ``queue`` with ``prefetch``, consuming;
    its connection (to close) and the list its messages are appended to."""
    got: list[Message] = []
    connection = Connection(url, transport=transport, transport_options=options or {})
    consumer = Consumer(connection.channel(), [Queue(queue, no_declare=True)], accept=["json"])
    consumer.qos(prefetch_count=prefetch)

    def received(message: Message) -> None:
        got.append(message)
        if on_message is not None:
            on_message(message)

    consumer.register_callback(lambda _body, message: received(message))
    consumer.consume()
    return connection, got


def _one_read(
    url: str,
    queue: str,
    prefetch: int,
    options: dict[str, int] | None = None,
    transport: Any = Transport,
) -> tuple[Connection, list[Message]]:
    """A batched consumer (or one of ``transport``) reads once; its connection (open, its
    messages unacknowledged) and what it received."""
    connection, got = _consumer(url, queue, prefetch, options=options, transport=transport)
    connection.drain_events(timeout=10)
    return connection, got


def _tag(raw: str) -> str:
    return str(json.loads(raw)["properties"]["delivery_tag"])


def _recorded(redis: Redis, raw: str) -> bool:
    """Whether kombu's records (hash and index) still hold the message as unacknowledged."""
    tag = _tag(raw)
    # One transaction: an ack's MULTI between two separate reads would split the pair.
    in_hash, score = redis.pipeline().hexists(UNACKED, tag).zscore(UNACKED_INDEX, tag).execute()
    assert bool(in_hash) == (score is not None), "the two records disagree"
    return bool(in_hash)


def test_one_read_takes_the_free_prefetch_and_records_each_as_kombu_does(
    infra: LocalStack, redis: Redis, queue: str
) -> None:
    raws = _push(redis, queue, 10)
    connection, got = _one_read(infra.redis_url, queue, prefetch=4)
    try:
        # One BRPOP and one script: four messages, oldest first, six left on the list.
        assert [m.delivery_tag for m in got] == [_tag(r) for r in raws[:4]]
        assert redis.llen(queue) == 6
        for raw in raws[:4]:
            # Exactly kombu's QoS.append record: [payload, exchange, routing key].
            record = redis.hget(UNACKED, _tag(raw))
            assert record is not None
            assert json.loads(record) == [json.loads(raw), "", queue]
            assert redis.zscore(UNACKED_INDEX, _tag(raw)) is not None
        # An ack removes them (written by the ack writer, a moment later), and the QoS knows
        # they are no longer delivered at once.
        got[0].ack()
        got[1].ack()
        until(lambda: redis.hget(UNACKED, _tag(raws[0])) is None)
        until(lambda: redis.zscore(UNACKED_INDEX, _tag(raws[1])) is None)
        assert redis.hget(UNACKED, _tag(raws[2])) is not None
        # Two places free again: the next read takes two, not more.
        before = len(got)
        connection.drain_events(timeout=10)
        assert len(got) - before == 2
        assert redis.llen(queue) == 4
    finally:
        connection.close()


def test_without_a_prefetch_limit_a_read_takes_at_most_a_batch(
    infra: LocalStack, redis: Redis, queue: str
) -> None:
    _push(redis, queue, RECEIVE_BATCH + 5)
    connection, got = _one_read(infra.redis_url, queue, prefetch=0)
    try:
        assert len(got) == RECEIVE_BATCH
        assert redis.llen(queue) == 5
    finally:
        connection.close()


@pytest.mark.parametrize("batch", [1, 3])
def test_the_batch_setting_bounds_a_read(
    infra: LocalStack, redis: Redis, queue: str, batch: int
) -> None:
    """``LORAFLEET_RECEIVE_BATCH`` reaches the channel as the transport option ``receive_batch``;
    1 reads one message at a time, recorded by kombu's own ``QoS.append``."""
    raws = _push(redis, queue, 10)
    connection, got = _one_read(
        infra.redis_url, queue, prefetch=8, options={"receive_batch": batch}
    )
    try:
        assert [m.delivery_tag for m in got] == [_tag(r) for r in raws[:batch]]
        assert redis.llen(queue) == 10 - batch
        # 1 is kombu's own read: the receipt script is never loaded.
        assert (got[0].channel._receive_script is None) == (batch == 1)
        assert json.loads(redis.hget(UNACKED, _tag(raws[0])) or "null") == [
            json.loads(raws[0]),
            "",
            queue,
        ]
    finally:
        connection.close()


def test_kombus_restore_by_tag_puts_a_batched_delivery_back(
    infra: LocalStack, redis: Redis, queue: str
) -> None:
    """What ``worker.reaper`` does for a dead worker's deliveries: kombu's own transport restores
    them from the records the batched receipt wrote."""
    raws = _push(redis, queue, 3)
    connection, got = _one_read(infra.redis_url, queue, prefetch=3)
    try:
        assert len(got) == 3 and redis.llen(queue) == 0
        with Connection(infra.redis_url) as plain:
            qos = plain.default_channel.qos
            for raw in raws:
                qos.restore_by_tag(_tag(raw))
        assert all(redis.hget(UNACKED, _tag(r)) is None for r in raws)
        assert all(redis.zscore(UNACKED_INDEX, _tag(r)) is None for r in raws)
        back = [json.loads(r) for r in _list(redis, queue)]
        assert sorted(m["properties"]["delivery_tag"] for m in back) == sorted(map(_tag, raws))
        assert all(m["headers"]["redelivered"] for m in back)
    finally:
        connection.close()


def test_a_message_the_script_cannot_read_is_left_at_the_head_of_the_queue(
    infra: LocalStack, redis: Redis, queue: str
) -> None:
    first = _push(redis, queue, 2)
    redis.lpush(queue, "not json")
    last = _push(redis, queue, 1)[0]
    connection, got = _one_read(infra.redis_url, queue, prefetch=10)
    try:
        # The two before it in one read; the batch stops at it.
        assert [m.delivery_tag for m in got] == [_tag(r) for r in first]
        # Put back where it was: read next (by kombu, which decides what to do with it).
        assert _list(redis, queue) == [last, "not json"]
    finally:
        connection.close()


def test_messages_not_handed_over_go_back_to_the_head_of_their_queue(
    infra: LocalStack, redis: Redis, queue: str
) -> None:
    raws = _push(redis, queue, 5)

    def fail_on_the_second(message: Message) -> None:
        if message.delivery_tag == _tag(raws[1]):
            raise RuntimeError("the consumer failed")

    connection, got = _consumer(infra.redis_url, queue, 4, on_message=fail_on_the_second)
    try:
        with pytest.raises(RuntimeError, match="the consumer failed"):
            connection.drain_events(timeout=10)
        assert [m.delivery_tag for m in got] == [_tag(raws[0]), _tag(raws[1])]
        # The third and fourth were taken and recorded, never handed over: back on the queue,
        # in order, next to be read (LPUSHed, so the list's last is read first); their
        # records gone. The first two were handed over: recorded, as with kombu alone.
        assert [_tag(r) for r in _list(redis, queue)] == [_tag(raws[i]) for i in (4, 3, 2)]
        assert redis.hget(UNACKED, _tag(raws[2])) is None
        assert redis.zscore(UNACKED_INDEX, _tag(raws[3])) is None
        assert redis.hget(UNACKED, _tag(raws[1])) is not None
    finally:
        connection.close()
    # Closing hands back what it was given and did not acknowledge (kombu's restore at
    # shutdown): all five on the queue, no record left.
    assert sorted(_tag(r) for r in _list(redis, queue)) == sorted(map(_tag, raws))
    assert not any(redis.hget(UNACKED, _tag(r)) for r in raws)


def _list(redis: Redis, queue: str) -> list[str]:
    return [str(r) for r in redis.lrange(queue, 0, -1)]  # type: ignore[union-attr]


@pytest.mark.parametrize(
    ("env", "transport"),
    [
        ({}, "worker.receive:Transport"),
        ({"LORAFLEET_RECEIVE_BATCH": "8"}, "worker.receive:Transport"),
        ({"LORAFLEET_RECEIVE_BATCH": "1"}, None),
        (
            {"LORAFLEET_RECEIVE_BATCH": "8", "LORAFLEET_BROKER_URL": "sentinel://localhost:26379"},
            None,
        ),
    ],
)
def test_the_worker_receives_in_batches_by_default_on_plain_redis_brokers(
    env: dict[str, str], transport: str | None
) -> None:
    """On by default, at ``LORAFLEET_RECEIVE_BATCH`` (16 unless set), for plain Redis brokers
    only (a given transport would override a ``sentinel://`` URL's); at 1 the worker reads as
    kombu does, with kombu's own transport and no extra transport option."""
    probe = (
        "import json; from worker.celery_app import app; "
        "print(json.dumps([app.conf.broker_transport, "
        "app.conf.broker_transport_options.get('receive_batch')]))"
    )
    clean = {k: v for k, v in os.environ.items() if not k.startswith("LORAFLEET_")}
    done = subprocess.run(
        [sys.executable, "-c", probe], env={**clean, **env}, capture_output=True, text=True
    )
    assert done.returncode == 0, done.stderr
    chosen, batch = json.loads(done.stdout.strip().splitlines()[-1])
    assert chosen == transport
    expected = int(env.get("LORAFLEET_RECEIVE_BATCH", RECEIVE_BATCH))
    assert batch == (expected if transport else None)


def test_acks_that_arrive_while_a_write_is_out_share_the_next_write(
    infra: LocalStack, redis: Redis, queue: str
) -> None:
    """Acks are gathered: eight acks made while the first write is held take at most two
    writes (one round trip each) instead of eight, and every record goes."""
    raws = _push(redis, queue, 8)
    connection, got = _one_read(infra.redis_url, queue, prefetch=8)
    try:
        assert len(got) == 8
        acks = got[0].channel.qos.acks
        write, writes, held = acks._write, [], threading.Event()

        def held_write(tags: list[str]) -> None:
            writes.append(list(tags))
            assert held.wait(10)
            write(tags)

        acks._write = held_write
        for message in got:
            message.ack()
        held.set()
        until(lambda: not any(_recorded(redis, r) for r in raws))
        assert 1 <= len(writes) <= 2
        assert sorted(t for w in writes for t in w) == sorted(map(_tag, raws))
    finally:
        connection.close()


def test_closing_the_channel_writes_its_pending_acks_and_restores_only_the_rest(
    infra: LocalStack, redis: Redis, queue: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A warm shutdown leaves nothing acknowledged on record: closing writes the pending acks,
    then kombu puts back what was delivered and not acknowledged."""
    monkeypatch.setattr(receive, "ACK_COALESCE_S", 3600.0)  # only the close writes them
    raws = _push(redis, queue, 5)
    connection, got = _one_read(infra.redis_url, queue, prefetch=5)
    try:
        for message in got[:3]:
            message.ack()
        assert all(_recorded(redis, r) for r in raws)  # pending, not written yet
    finally:
        connection.close()
    assert not any(_recorded(redis, r) for r in raws)
    assert sorted(_tag(r) for r in _list(redis, queue)) == sorted(_tag(r) for r in raws[3:])


@pytest.mark.parametrize("gives_up", [False, True])
def test_acks_redis_refuses_are_retried_for_a_while_then_left_to_the_visibility_timeout(
    infra: LocalStack,
    redis: Redis,
    queue: str,
    monkeypatch: pytest.MonkeyPatch,
    caplog: pytest.LogCaptureFixture,
    gives_up: bool,
) -> None:
    monkeypatch.setattr(receive, "ACK_RETRY_S", 0.01)
    monkeypatch.setattr(receive, "ACK_GIVE_UP_S", 0.0 if gives_up else 3600.0)
    raws = _push(redis, queue, 3)
    connection, got = _one_read(infra.redis_url, queue, prefetch=3)
    try:
        acks = got[0].channel.qos.acks
        write, tries = acks._write, []

        def refused_once(tags: list[str]) -> None:
            tries.append(list(tags))
            if len(tries) == 1:
                raise RedisConnectionError("Redis went away")
            write(tags)

        acks._write = refused_once
        with caplog.at_level(logging.WARNING, logger="worker.background"):
            got[0].ack()
            if gives_up:
                until(lambda: "the visibility timeout returns" in caplog.text)
                assert _recorded(redis, raws[0])  # left for the visibility timeout
            else:
                until(lambda: not _recorded(redis, raws[0]))
                assert "retrying" in caplog.text
                assert tries[1] == tries[0] == [_tag(raws[0])]
        # The writer lives on: the next ack is written.
        got[1].ack()
        until(lambda: not _recorded(redis, raws[1]))
        assert _recorded(redis, raws[2])
    finally:
        connection.close()


def test_one_at_a_time_acks_as_kombu_does(infra: LocalStack, redis: Redis, queue: str) -> None:
    """``LORAFLEET_RECEIVE_BATCH=1``: the ack is kombu's own ``MULTI``, written before it
    returns; no ack writer is started."""
    raws = _push(redis, queue, 1)
    connection, got = _one_read(infra.redis_url, queue, prefetch=1, options={"receive_batch": 1})
    try:
        got[0].ack()
        assert not _recorded(redis, raws[0])
        assert got[0].channel.qos.acks._thread is None
    finally:
        connection.close()


@pytest.mark.parametrize("transport", [Transport, kombu_redis.Transport], ids=["batched", "kombu"])
def test_an_ack_of_a_delivery_taken_over_leaves_its_record_for_the_new_holder(
    infra: LocalStack, redis: Redis, queue: str, transport: Any
) -> None:
    """Another worker received the same message again (same delivery tag) and runs its job:
    this worker's ack only forgets the delivery here (closing the channel does not put it
    back either). The record stays for the new holder, and once that delivery comes back
    (its holder died: restored by tag) a later ack removes it."""
    raws = _push(redis, queue, 2)
    taken, kept = _tag(raws[0]), _tag(raws[1])
    connection, got = _one_read(infra.redis_url, queue, prefetch=2, transport=transport)
    try:
        if transport is not Transport:
            connection.drain_events(timeout=10)  # one message a read
        assert [m.delivery_tag for m in got] == [taken, kept]
        receive.taken_over(taken)
        for message in got:
            message.ack()
        until(lambda: not _recorded(redis, raws[1]))
    finally:
        connection.close()  # puts back what was delivered and not acknowledged: nothing
    assert _recorded(redis, raws[0])
    assert redis.llen(queue) == 0
    # The new holder dies; its delivery is handed back and received here again.
    with Connection(infra.redis_url) as plain:
        plain.default_channel.qos.restore_by_tag(taken)
    connection, got = _one_read(infra.redis_url, queue, prefetch=1, transport=transport)
    try:
        assert [m.delivery_tag for m in got] == [taken]
        got[0].ack()
        until(lambda: not _recorded(redis, raws[0]))
    finally:
        connection.close()
