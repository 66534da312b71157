"""A raw TCP server for tests that need a peer to misbehave: hang, hang up, or trickle."""

from __future__ import annotations

import socket
import threading
from collections.abc import Callable, Iterator
from contextlib import contextmanager


@contextmanager
def tcp_server(
    handler: Callable[[socket.socket], None],
) -> Iterator[tuple[int, list[socket.socket]]]:
    """Listens on a loopback port; runs ``handler`` on each connection (in a thread of its
    own) and keeps every accepted connection open until exit. Yields ``(port, accepted)``."""
    server = socket.socket()
    server.bind(("127.0.0.1", 0))
    server.listen(64)
    server.settimeout(0.2)
    accepted: list[socket.socket] = []
    stop = threading.Event()

    def serve() -> None:
        while not stop.is_set():
            try:
                conn, _ = server.accept()
            except OSError:
                continue
            accepted.append(conn)
            threading.Thread(target=handler, args=(conn,), daemon=True).start()

    thread = threading.Thread(target=serve, daemon=True)
    thread.start()
    try:
        yield server.getsockname()[1], accepted
    finally:
        stop.set()
        thread.join()
        for conn in accepted:
            conn.close()
        server.close()


def hang(_: socket.socket) -> None:
    """Accept and never answer (a hung Redis, a stalled receiver)."""
