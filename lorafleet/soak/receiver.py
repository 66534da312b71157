"""The soak's webhook receiver: checks every call's signature as a real receiver must, and
flaps: it answers 503 through a down window of every period, and 500 to a share of the rest
at random, so deliveries are retried while everything else is failing too.

It records each call by event id, so the soak can count what a receiver that does not
deduplicate would have done twice: a delivery of an event it had already answered 2xx.
"""

from __future__ import annotations

import random
import threading
import time
from collections import defaultdict
from dataclasses import dataclass, field
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any

from lorafleet.client import verify_webhook
from lorafleet.processes import free_port


@dataclass
class Delivery:
    at: float
    answered: int
    verified: bool
    payload: dict[str, Any] | None


@dataclass
class FlappingReceiver:
    secrets: list[str]
    """every tenant's signing secret; a call must verify with one of them"""
    period_s: float = 40.0
    down_s: float = 8.0
    error_share: float = 0.15
    port: int = field(default_factory=free_port)
    seed: int = 11
    calls: dict[str, list[Delivery]] = field(default_factory=lambda: defaultdict(list))
    _lock: threading.Lock = field(default_factory=threading.Lock)
    _server: ThreadingHTTPServer | None = None
    _began: float = 0.0

    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}/hook"

    def _answer(self, rng: random.Random) -> int:
        if (time.monotonic() - self._began) % self.period_s < self.down_s:
            return 503
        return 500 if rng.random() < self.error_share else 200

    def start(self) -> None:
        receiver = self
        rng = random.Random(self.seed)
        self._began = time.monotonic()

        class Handler(BaseHTTPRequestHandler):
            def do_POST(self) -> None:
                body = self.rfile.read(int(self.headers.get("content-length") or 0))
                headers = dict(self.headers.items())
                payload: dict[str, Any] | None = None
                for secret in receiver.secrets:
                    try:
                        payload = verify_webhook(headers, body, secret)
                        break
                    except ValueError:
                        continue
                with receiver._lock:
                    status = receiver._answer(rng) if payload is not None else 400
                    event_id = self.headers.get("webhook-id") or "(none)"
                    receiver.calls[event_id].append(
                        Delivery(time.time(), status, payload is not None, payload)
                    )
                self.send_response(status)
                self.send_header("content-length", "0")
                self.end_headers()

            def log_message(self, *_: Any) -> None:
                pass

        self._server = ThreadingHTTPServer(("127.0.0.1", self.port), Handler)
        threading.Thread(target=self._server.serve_forever, daemon=True).start()

    def stop(self) -> None:
        if self._server is not None:
            self._server.shutdown()
            self._server.server_close()
            self._server = None

    def deliveries(self) -> dict[str, list[Delivery]]:
        with self._lock:
            return {event_id: list(calls) for event_id, calls in self.calls.items()}
