"""A webhook receiver for tests: a real HTTP server on loopback that records every call and
answers with scripted statuses."""

from __future__ import annotations

import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any

from lorafleet.processes import free_port


@dataclass
class Call:
    path: str
    headers: dict[str, str]
    body: bytes
    at: float


@dataclass
class Receiver:
    """Records calls; answers ``script`` statuses in order, then ``default``."""

    port: int = field(default_factory=free_port)
    calls: list[Call] = field(default_factory=list)
    script: list[tuple[int, dict[str, str]]] = field(default_factory=list)
    default: int = 200
    _server: ThreadingHTTPServer | None = None
    _lock: threading.Lock = field(default_factory=threading.Lock)

    def url(self, path: str = "/hook") -> str:
        return f"http://127.0.0.1:{self.port}{path}"

    def start(self) -> None:
        receiver = self

        class Handler(BaseHTTPRequestHandler):
            def do_POST(self) -> None:
                length = int(self.headers.get("content-length") or 0)
                body = self.rfile.read(length)
                with receiver._lock:
                    receiver.calls.append(
                        Call(
                            self.path,
                            {k.lower(): v for k, v in self.headers.items()},
                            body,
                            time.time(),
                        )
                    )
                    status, headers = (
                        receiver.script.pop(0) if receiver.script else (receiver.default, {})
                    )
                self.send_response(status)
                for name, value in headers.items():
                    self.send_header(name, value)
                self.send_header("content-length", "2")
                self.end_headers()
                self.wfile.write(b"ok")

            def log_message(self, *_: Any) -> None:
                pass

        self._server = ThreadingHTTPServer(("127.0.0.1", self.port), Handler)
        threading.Thread(target=self._server.serve_forever, daemon=True).start()

    def stop(self) -> None:
        if self._server is not None:
            self._server.shutdown()
            self._server.server_close()
            self._server = None

    def calls_for(self, event_id: str) -> list[Call]:
        with self._lock:
            return [c for c in self.calls if c.headers.get("webhook-id") == event_id]

    def wait_for(self, event_id: str, count: int = 1, timeout_s: float = 120) -> list[Call]:
        deadline = time.monotonic() + timeout_s
        while len(calls := self.calls_for(event_id)) < count:
            assert time.monotonic() < deadline, f"{event_id}: {len(calls)} of {count} calls"
            time.sleep(0.05)
        return calls


@contextmanager
def receiving(**options: Any) -> Iterator[Receiver]:
    receiver = Receiver(**options)
    receiver.start()
    try:
        yield receiver
    finally:
        receiver.stop()
