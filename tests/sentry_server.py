"""A server that accepts Sentry envelopes, for tests of what the services report."""

from __future__ import annotations

import gzip
import json
import threading
from collections.abc import Iterator
from contextlib import contextmanager
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any

from lorafleet.processes import free_port


@contextmanager
def recording_sentry() -> Iterator[tuple[str, list[bytes]]]:
    """A server that accepts Sentry envelopes; yields its DSN and the (decoded) bodies."""
    received: list[bytes] = []

    class Handler(BaseHTTPRequestHandler):
        def do_POST(self) -> None:
            body = self.rfile.read(int(self.headers.get("content-length") or 0))
            if self.headers.get("content-encoding") == "gzip":
                body = gzip.decompress(body)
            received.append(body)
            self.send_response(200)
            self.send_header("content-length", "2")
            self.end_headers()
            self.wfile.write(b"{}")

        def log_message(self, *_: Any) -> None:
            pass

    port = free_port()
    server = ThreadingHTTPServer(("127.0.0.1", port), Handler)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    try:
        yield f"http://public@127.0.0.1:{port}/1", received
    finally:
        server.shutdown()
        server.server_close()


def sentry_events(bodies: list[bytes]) -> list[dict[str, Any]]:
    """The ``event`` items of Sentry envelopes (header line, then item header + payload)."""
    events = []
    for body in bodies:
        lines = body.split(b"\n")
        for header, payload in zip(lines[1::2], lines[2::2], strict=False):
            if json.loads(header).get("type") == "event":
                events.append(json.loads(payload))
    return events
