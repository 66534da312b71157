"""Script calls of many job threads, sent to Redis together.

Every job makes its claim and its outcome write through a Lua script. Made one round trip
each from each job's own thread, they cost more Python than the rest of the job's handling
(packing, a socket round trip, parsing, the GIL handed back and forth), measured at ~1.1 ms
of CPU per job. Here one thread sends every call waiting at that moment in one pipeline,
and the calling threads wait for their own replies: under load, one round trip serves many
jobs; alone, a call costs a thread hand-off more than before.

The batch has a client of its own whose reads time out (``SOCKET_TIMEOUT_S``): a Redis that
stops answering fails the calls waiting on it, which their callers retry, instead of
holding every job thread for ever.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Sequence
from concurrent.futures import Future
from dataclasses import dataclass, field
from typing import Any

from redis import Redis
from redis.commands.core import Script
from redis.exceptions import NoScriptError

from contracts.redis_policy import sync_client
from worker.background import Background

log = logging.getLogger(__name__)

SOCKET_TIMEOUT_S = 10.0
"""Longest wait for a batch's replies: far beyond any batch's time in a Redis that works
(a script call takes microseconds there), short against a job's deadline."""


@dataclass
class _Call:
    script: Script
    keys: Sequence[Any]
    args: Sequence[Any]
    reply: Future[Any] = field(default_factory=Future)


class ScriptBatch:
    """Runs ``Script`` calls from any thread; ``start`` it once, ``close`` it at shutdown.

    ``redis`` is the batch's own client (one connection is all it uses), with a socket
    timeout: ``script_client`` makes one."""

    def __init__(self, redis: Redis) -> None:
        self._redis = redis
        self._cond = threading.Condition()
        self._pending: list[_Call] = []
        self._sender = Background("script-batch", self._run, join_timeout_s=5)

    def start(self) -> None:
        self._sender.start()

    def close(self) -> None:
        with self._cond:
            self._sender.stopping.set()
            self._cond.notify_all()
        self._sender.close()
        with self._cond:  # the sender never started, or gave up: nobody will send these
            left, self._pending = self._pending, []
        for call in left:
            call.reply.set_exception(RuntimeError("the script batch closed before sending this"))
        self._redis.close()

    def call(self, script: Script, keys: Sequence[Any], args: Sequence[Any]) -> Any:
        """``script(keys, args)``'s reply, or the error Redis gave it (a connection error
        for the whole batch it went in)."""
        call = _Call(script, keys, args)
        with self._cond:
            if self._sender.stopping.is_set():
                raise RuntimeError("the script batch is closed")
            self._pending.append(call)
            self._cond.notify()
        return call.reply.result()

    def _run(self, stopping: threading.Event) -> None:
        while True:
            with self._cond:
                while not self._pending and not stopping.is_set():
                    self._cond.wait()
                batch, self._pending = self._pending, []
            if not batch:
                return
            try:
                self._send(batch)
            except Exception as exc:  # the connection, or anything else: every caller hears
                for call in batch:
                    if not call.reply.done():
                        call.reply.set_exception(exc)

    def _send(self, batch: list[_Call]) -> None:
        replies = self._pipeline(batch)
        unknown = []
        for call, reply in zip(batch, replies, strict=True):
            if _noscript(reply):
                unknown.append(call)
            else:  # answered now, whatever happens to the others
                _settle(call, reply)
        if not unknown:
            return
        # A restarted (or another) server: load what it lacks, then send those again.
        for script in {call.script.sha: call.script for call in unknown}.values():
            script.sha = self._redis.script_load(script.script)
        for call, reply in zip(unknown, self._pipeline(unknown), strict=True):
            _settle(call, reply)

    def _pipeline(self, calls: list[_Call]) -> list[Any]:
        pipe = self._redis.pipeline(transaction=False)
        for call in calls:
            pipe.evalsha(call.script.sha, len(call.keys), *call.keys, *call.args)
        return pipe.execute(raise_on_error=False)


def script_client(url: str, timeout_s: float = SOCKET_TIMEOUT_S) -> Redis:
    """A client for a ``ScriptBatch``: reads bounded by ``timeout_s``, and no retry of
    its own. A pipeline retried after a timeout would run every script in it twice; the
    callers retry instead, call by call, and their scripts know a resend of themselves
    (``CLAIM``, ``ADVANCE``)."""
    return sync_client(
        url,
        max_connections=2,
        pool_timeout_s=timeout_s,
        retries=0,
        decode_responses=True,
        socket_timeout=timeout_s,
        socket_connect_timeout=timeout_s,
    )


def _settle(call: _Call, reply: Any) -> None:
    if isinstance(reply, Exception):
        call.reply.set_exception(reply)
    else:
        call.reply.set_result(reply)


def _noscript(reply: Any) -> bool:
    return isinstance(reply, NoScriptError)
