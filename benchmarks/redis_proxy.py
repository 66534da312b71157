"""A counting TCP proxy for Redis: what one client process sends, in commands and round trips.

Each ``Tap`` listens on a port of its own and forwards every connection to the real server,
byte for byte. On the way it parses the client's requests (RESP arrays, as every Redis client
sends them) and counts:

- commands, by name as ``INFO commandstats`` names them (``hset``, ``client|setinfo``), and
  script calls (``evalsha``/``eval``/``fcall``) by the script they run;
- round trips: a client write that finds every earlier request of its connection answered
  starts one round trip, however many commands it holds: a pipeline or a ``MULTI`` block
  written at once counts one, as does a blocking command however long it waits. Replies are
  counted as the server sends them (RESP2 and RESP3); what it pushes unasked (pub/sub
  messages) answers nothing;
- connections opened, and bytes each way.

The taps run on an asyncio loop in a thread of their own (``Taps``), so a caller that blocks
(starting services, waiting for them) does not stall the traffic it counts.

Used by ``benchmarks/redis_cost.py`` (the taps) and ``benchmarks/redis_capacity.py`` (its reply
counter); it imports nothing of the project.
"""

from __future__ import annotations

import asyncio
import contextlib
import hashlib
import re
import threading
from collections import Counter
from collections.abc import Callable
from concurrent.futures import Future
from dataclasses import dataclass, field
from typing import Any

CONTAINERS = {
    b"acl", b"client", b"cluster", b"command", b"config", b"function", b"latency", b"memory",
    b"module", b"object", b"pubsub", b"script", b"slowlog", b"xgroup", b"xinfo",
}  # fmt: skip
"""Commands that ``INFO commandstats`` counts per subcommand (``script|load``)."""

SCRIPT_CALLS = {b"evalsha", b"evalsha_ro", b"eval", b"eval_ro", b"fcall", b"fcall_ro"}

_ID = re.compile(r"^[0-9a-f]{12,}$|^[0-9a-f-]{36}$|^\d+(\.\d+)?$|^evt_\w+$")


def key_shape(key: str) -> str:
    """A key with its ids starred: ``lorafleet:job:3f2a...`` -> ``job:*``."""
    parts = key.split(":")
    if parts[0] == "lorafleet":
        parts = parts[1:]
    return ":".join("*" if _ID.match(part) else part for part in parts)


@dataclass
class Counts:
    """What one tap saw (or a difference of two snapshots)."""

    connections: int = 0
    round_trips: int = 0
    bytes_up: int = 0
    bytes_down: int = 0
    commands: Counter[str] = field(default_factory=Counter)
    scripts: Counter[str] = field(default_factory=Counter)

    def copy(self) -> Counts:
        return Counts(
            self.connections,
            self.round_trips,
            self.bytes_up,
            self.bytes_down,
            Counter(self.commands),
            Counter(self.scripts),
        )

    def minus(self, other: Counts) -> Counts:
        """``self - other``, keeping negative entries (a background rate subtracted from a
        busy window may overshoot a little)."""
        commands = Counter(self.commands)
        commands.subtract(other.commands)
        scripts = Counter(self.scripts)
        scripts.subtract(other.scripts)
        return Counts(
            self.connections - other.connections,
            self.round_trips - other.round_trips,
            self.bytes_up - other.bytes_up,
            self.bytes_down - other.bytes_down,
            Counter({k: v for k, v in commands.items() if v}),
            Counter({k: v for k, v in scripts.items() if v}),
        )

    def as_json(self) -> dict[str, Any]:
        """The counts as plain JSON (numbers, and dicts of numbers by name)."""
        return {
            "connections": self.connections,
            "round_trips": self.round_trips,
            "bytes_up": self.bytes_up,
            "bytes_down": self.bytes_down,
            "commands": dict(sorted(self.commands.items())),
            "scripts": dict(sorted(self.scripts.items())),
        }


SUBSCRIPTIONS = {
    b"subscribe", b"psubscribe", b"ssubscribe", b"unsubscribe", b"punsubscribe", b"sunsubscribe",
}  # fmt: skip
"""Commands confirmed by pushes (RESP3), or by arrays that look like them (RESP2), one per
channel: no reply of theirs is awaited."""

PUSHES = {b"message", b"pmessage", b"smessage"} | SUBSCRIPTIONS
"""First element of a RESP2 array that a subscribed connection receives as a push."""


class RequestParser:
    """Splits a client's byte stream into commands (lists of arguments), resumably: a
    command cut across reads is completed by the next ``feed``."""

    def __init__(self) -> None:
        self._buf = bytearray()
        self._pos = 0
        self._left = 0  # arguments still to read of the current array
        self._args: list[bytes] = []

    @property
    def mid_command(self) -> bool:
        """Part of a command has arrived and the rest has not."""
        return self._left > 0 or len(self._buf) > 0

    def feed(self, data: bytes) -> list[list[bytes]]:
        self._buf += data
        done: list[list[bytes]] = []
        while True:
            if self._left == 0:
                line = self._line()
                if line is None:
                    break
                if not line.startswith(b"*"):  # an inline command (telnet-style)
                    if line.strip():
                        done.append(line.split())
                    continue
                self._left, self._args = int(line[1:]), []
                if self._left <= 0:
                    continue
            arg = self._bulk()
            if arg is None:
                break
            self._args.append(arg)
            self._left -= 1
            if self._left == 0:
                done.append(self._args)
        del self._buf[: self._pos]
        self._pos = 0
        return done

    def _line(self) -> bytes | None:
        end = self._buf.find(b"\r\n", self._pos)
        if end < 0:
            return None
        line = bytes(self._buf[self._pos : end])
        self._pos = end + 2
        return line

    def _bulk(self) -> bytes | None:
        start = self._pos
        header = self._line()
        if header is None:
            return None
        size = int(header[1:])
        if len(self._buf) < self._pos + size + 2:
            self._pos = start  # read the header again once the rest is there
            return None
        arg = bytes(self._buf[self._pos : self._pos + size])
        self._pos += size + 2
        return arg


AGGREGATES = {ord("*"): 1, ord("~"): 1, ord(">"): 1, ord("%"): 2, ord("|"): 2}
"""RESP aggregate types and the elements each of their count stands for (maps: pairs)."""

BULKS = {ord("$"), ord("!"), ord("=")}


class ReplyCounter:
    """Counts the complete replies in a server's byte stream, resumably; pub/sub pushes
    (RESP3 ``>``, or RESP2 ``message`` arrays once ``subscribed``) and attributes are not
    replies."""

    def __init__(self) -> None:
        self.subscribed = False
        self.errors = 0  # error replies seen
        self._buf = bytearray()
        self._pos = 0
        self._open: list[int] = []  # elements still to come, per open aggregate
        self._bulk: int | None = None  # bytes of a bulk string still to come
        self._top = 0  # type byte of the reply being read
        self._first: bytes | None = None  # its first element, if a bulk string

    def feed(self, data: bytes) -> int:
        self._buf += data
        replies = 0
        while True:
            if self._bulk is not None:
                end = self._pos + self._bulk
                if len(self._buf) < end + 2:
                    break
                if len(self._open) == 1 and self._first is None:
                    self._first = bytes(self._buf[self._pos : end])
                self._pos, self._bulk = end + 2, None
                replies += self._element_done()
                continue
            end = self._buf.find(b"\r\n", self._pos)
            if end < 0:
                break
            kind, size = self._buf[self._pos], self._buf[self._pos + 1 : end]
            self._pos = end + 2
            if not self._open:
                self._top, self._first = kind, None
            if kind in BULKS and int(size) >= 0:
                self._bulk = int(size)
            elif kind in AGGREGATES and int(size) > 0:
                self._open.append(int(size) * AGGREGATES[kind])
            else:
                replies += self._element_done()
        del self._buf[: self._pos]
        self._pos = 0
        return replies

    def _element_done(self) -> int:
        """One element ended; 1 if it ended a reply."""
        while self._open:
            self._open[-1] -= 1
            if self._open[-1]:
                return 0
            self._open.pop()
        if self._top == ord(">") or self._top == ord("|"):
            return 0
        if self._top == ord("-") or self._top == ord("!"):
            self.errors += 1
        if self.subscribed and self._top == ord("*") and self._first in PUSHES:
            return 0
        return 1


class Tap:
    """One listening port in front of ``upstream``; counts in ``counts`` (loop thread only)."""

    def __init__(
        self, name: str, upstream: tuple[str, int], script_name: Callable[[str, list[str]], str]
    ) -> None:
        self.name = name
        self.counts = Counts()
        self._upstream = upstream
        self._script_name = script_name
        self._server: asyncio.Server | None = None
        self._links: set[asyncio.Task[None]] = set()
        self.port = 0

    async def start(self) -> None:
        self._server = await asyncio.start_server(self._accept, "127.0.0.1", 0)
        self.port = self._server.sockets[0].getsockname()[1]

    async def close(self) -> None:
        if self._server is not None:
            self._server.close()
        for task in list(self._links):
            task.cancel()
        await asyncio.gather(*self._links, return_exceptions=True)

    async def _accept(self, client_r: asyncio.StreamReader, client_w: asyncio.StreamWriter) -> None:
        task = asyncio.current_task()
        assert task is not None
        self._links.add(task)
        try:
            server_r, server_w = await asyncio.open_connection(*self._upstream)
        except OSError:
            client_w.close()
            self._links.discard(task)
            return
        self.counts.connections += 1
        requests, replies = RequestParser(), ReplyCounter()
        unanswered = 0

        async def upward() -> None:
            nonlocal unanswered
            while data := await client_r.read(1 << 20):
                if unanswered == 0 and not requests.mid_command:
                    self.counts.round_trips += 1
                self.counts.bytes_up += len(data)
                for command in requests.feed(data):
                    self._count(command)
                    if command[0].lower() in SUBSCRIPTIONS:
                        replies.subscribed = True
                    else:
                        unanswered += 1
                server_w.write(data)
                await server_w.drain()

        async def downward() -> None:
            nonlocal unanswered
            while data := await server_r.read(1 << 20):
                self.counts.bytes_down += len(data)
                # Counted before the client can see them: its next request finds them counted.
                unanswered = max(0, unanswered - replies.feed(data))
                client_w.write(data)
                await client_w.drain()

        pumps = [asyncio.ensure_future(upward()), asyncio.ensure_future(downward())]
        try:
            await asyncio.wait(pumps, return_when=asyncio.FIRST_COMPLETED)
        except asyncio.CancelledError:
            pass
        finally:
            for pump in pumps:
                pump.cancel()
            await asyncio.gather(*pumps, return_exceptions=True)
            for writer in (client_w, server_w):
                with contextlib.suppress(Exception):
                    writer.close()
            self._links.discard(task)

    def _count(self, command: list[bytes]) -> None:
        if not command:
            return
        name = command[0].lower()
        if name in CONTAINERS and len(command) > 1:
            label = f"{name.decode()}|{command[1].lower().decode(errors='replace')}"
        else:
            label = name.decode(errors="replace")
        self.counts.commands[label] += 1
        if name in SCRIPT_CALLS and len(command) >= 3:
            ident = command[1].decode(errors="replace")
            if name.startswith(b"eval") and not name.startswith(b"evalsha"):
                ident = hashlib.sha1(command[1]).hexdigest()
            keys = [k.decode(errors="replace") for k in command[3 : 3 + int(command[2])]]
            self.counts.scripts[self._script_name(ident, keys)] += 1


class Taps:
    """Taps named by ``names`` in front of one Redis server, on a loop in their own thread.

    A context manager: on exit every tap and the thread stop."""

    def __init__(
        self,
        names: list[str],
        upstream: tuple[str, int],
        script_name: Callable[[str, list[str]], str],
    ) -> None:
        self._loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self._loop.run_forever, name="taps", daemon=True)
        self.taps = {name: Tap(name, upstream, script_name) for name in names}

    def __enter__(self) -> Taps:
        self._thread.start()
        for tap in self.taps.values():
            self._run(tap.start())
        return self

    def __exit__(self, *_: object) -> None:
        for tap in self.taps.values():
            self._run(tap.close())
        self._loop.call_soon_threadsafe(self._loop.stop)
        self._thread.join(timeout=10)
        if not self._thread.is_alive():
            self._loop.close()

    def url(self, name: str, db: int = 0) -> str:
        return f"redis://127.0.0.1:{self.taps[name].port}/{db}"

    def snapshot(self) -> dict[str, Counts]:
        """A consistent copy of every tap's counts (taken on the taps' loop)."""

        async def copy() -> dict[str, Counts]:
            return {name: tap.counts.copy() for name, tap in self.taps.items()}

        return self._run(copy())

    def _run(self, coroutine: Any) -> Any:
        future: Future[Any] = asyncio.run_coroutine_threadsafe(coroutine, self._loop)
        return future.result(timeout=30)
