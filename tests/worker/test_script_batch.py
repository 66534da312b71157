"""The worker's script batch (``worker.script_batch``) against a real Redis: every caller gets
its own reply, whatever happened to the others in its batch."""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Iterator
from concurrent.futures import Future
from typing import Any

import pytest
from redis import Redis
from redis.commands.core import Script
from redis.exceptions import ResponseError, TimeoutError

from lorafleet.stack import LocalStack
from worker.script_batch import ScriptBatch, script_client

ECHO = "return ARGV[1]"
FAILS = "return redis.call('NO.SUCH.COMMAND')"
BROKEN = "return ("  # does not compile: loading it fails


@pytest.fixture
def batch(infra: LocalStack) -> Iterator[ScriptBatch]:
    batch = ScriptBatch(script_client(infra.redis_url))
    yield batch
    batch.close()


def _calling(batch: ScriptBatch, script: Script, arg: str) -> Future[Any]:
    """``batch.call`` on a thread of its own (callers block until their reply)."""
    reply: Future[Any] = Future()

    def call() -> None:
        try:
            reply.set_result(batch.call(script, [], [arg]))
        except Exception as exc:
            reply.set_exception(exc)

    threading.Thread(target=call, daemon=True).start()
    return reply


def _queued(batch: ScriptBatch, n: int) -> None:
    """Until ``n`` calls wait (the sender not started: they go out as one batch)."""
    for _ in range(500):
        if len(batch._pending) == n:
            return
        time.sleep(0.01)
    raise AssertionError(f"{len(batch._pending)} calls queued, not {n}")


def _script(redis: Redis, source: str) -> Script:
    return redis.register_script(source)


def _one_batch(batch: ScriptBatch, *calls: Callable[[], Future[Any]]) -> list[Future[Any]]:
    replies = [call() for call in calls]
    _queued(batch, len(calls))
    batch.start()
    return replies


def test_scripts_a_restarted_redis_lost_are_loaded_and_run_and_the_rest_answered(
    batch: ScriptBatch, redis: Redis
) -> None:
    echo = _script(redis, ECHO)
    redis.script_flush()  # what a restart does: the server no longer knows the script
    replies = _one_batch(
        batch,
        lambda: _calling(batch, echo, "a"),
        lambda: _calling(batch, _script(redis, "return ARGV[1] .. '!'"), "b"),
        lambda: _calling(batch, echo, "c"),
    )
    assert [reply.result(timeout=30) for reply in replies] == ["a", "b!", "c"]


def test_an_error_reaches_only_the_call_that_caused_it(batch: ScriptBatch, redis: Redis) -> None:
    echo, fails = _script(redis, ECHO), _script(redis, FAILS)
    echo.sha = redis.script_load(ECHO)
    fails.sha = redis.script_load(FAILS)
    replies = _one_batch(
        batch, lambda: _calling(batch, echo, "a"), lambda: _calling(batch, fails, "b")
    )
    assert replies[0].result(timeout=30) == "a"
    with pytest.raises(ResponseError):
        replies[1].result(timeout=30)


def test_calls_answered_before_a_reload_failed_keep_their_replies(
    batch: ScriptBatch, redis: Redis
) -> None:
    """A script Redis does not know and cannot load fails the calls of it; a call in the
    same batch that ran is answered with its reply (its write happened: an error would make
    its caller do it again)."""
    echo = _script(redis, ECHO)
    echo.sha = redis.script_load(ECHO)
    replies = _one_batch(
        batch,
        lambda: _calling(batch, echo, "ran"),
        lambda: _calling(batch, _script(redis, BROKEN), "never"),
    )
    assert replies[0].result(timeout=30) == "ran"
    with pytest.raises(ResponseError):
        replies[1].result(timeout=30)


def test_closing_fails_calls_nobody_will_send_and_refuses_new_ones(
    batch: ScriptBatch, redis: Redis
) -> None:
    waiting = _calling(batch, _script(redis, ECHO), "a")
    _queued(batch, 1)
    batch.close()  # never started
    with pytest.raises(RuntimeError, match="closed before sending"):
        waiting.result(timeout=30)
    with pytest.raises(RuntimeError, match="closed"):
        batch.call(_script(redis, ECHO), [], ["b"])


def test_a_redis_that_stops_answering_fails_the_calls_instead_of_holding_them(
    infra: LocalStack, redis: Redis
) -> None:
    """Writes paused (as a stalled or partitioned server looks to a client): the call fails
    with a timeout, which its caller (``JobStore``) retries; before, it waited for ever."""
    slow = ScriptBatch(script_client(infra.redis_url, timeout_s=0.3))
    echo = _script(redis, ECHO)
    echo.sha = redis.script_load(ECHO)
    slow.start()
    try:
        redis.client_pause(30_000, all=False)  # writes, and scripts that may write, wait
        waiting = _calling(slow, echo, "a")
        with pytest.raises(TimeoutError):
            waiting.result(timeout=30)
    finally:
        redis.client_unpause()
        slow.close()


def test_the_batch_client_never_resends_a_pipeline_itself() -> None:
    """A pipeline resent after a timeout would run every script in it twice (the first copy
    ran, or runs once the server catches up): the callers retry, call by call."""
    client = script_client("redis://127.0.0.1:1")
    retry = client.connection_pool.connection_kwargs["retry"]
    assert retry.get_retries() == 0
    client.close()
