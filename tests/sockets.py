"""A raw TCP server for tests that need a peer to misbehave: hang, hang up, trickle, or
answer late."""

from __future__ import annotations

import socket
import threading
import time
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


@contextmanager
def slow_replies(upstream_port: int, markers: list[bytes], delay_s: float) -> Iterator[int]:
    """A TCP proxy to ``127.0.0.1:upstream_port`` that holds back, by ``delay_s``, the reply
    to any request containing one of ``markers`` (one command in flight per connection, as
    redis-py sends them): the command runs upstream at once, its answer arrives late. Yields
    the proxy's port."""

    def relay(client: socket.socket) -> None:
        server = socket.create_connection(("127.0.0.1", upstream_port))
        held = threading.Event()

        def downstream() -> None:
            try:
                while data := server.recv(65536):
                    if held.is_set():
                        held.clear()
                        time.sleep(delay_s)
                    client.sendall(data)
            except OSError:
                pass
            finally:
                client.close()

        threading.Thread(target=downstream, daemon=True).start()
        try:
            while data := client.recv(65536):
                if any(marker in data for marker in markers):
                    held.set()
                server.sendall(data)
        except OSError:
            pass
        finally:
            server.close()

    with tcp_server(relay) as (port, _):
        yield port
