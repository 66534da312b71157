"""The head bound's count (``gateway.http_protocol``), fed reads exactly as cut here.

Over a real socket the kernel decides how a client's writes are split into the gateway's
reads, so a read that holds a body's tail and the start of the next head can't be produced
at will; here the protocol runs on a real event loop with a transport that records what it
is asked to write, and each ``data_received`` is one read.
"""

from __future__ import annotations

import asyncio
from typing import Any

import pytest
from uvicorn.config import Config
from uvicorn.server import ServerState

from gateway.http_protocol import MAX_HEAD_BYTES, BoundedHttpTools


async def _app(scope: dict[str, Any], receive: Any, send: Any) -> None:
    """Reads the whole body and answers its length."""
    size = 0
    while True:
        message = await receive()
        size += len(message.get("body", b""))
        if not message.get("more_body"):
            break
    body = str(size).encode()
    headers = [(b"content-length", str(len(body)).encode())]
    await send({"type": "http.response.start", "status": 200, "headers": headers})
    await send({"type": "http.response.body", "body": body})


class _Transport(asyncio.Transport):
    def __init__(self) -> None:
        super().__init__()
        self.written = b""
        self.closed = False
        self.protocol: asyncio.BaseProtocol | None = None

    def get_extra_info(self, name: str, default: Any = None) -> Any:
        return {"peername": ("127.0.0.1", 50000), "sockname": ("127.0.0.1", 8000)}.get(
            name, default
        )

    def write(self, data: bytes | bytearray | memoryview) -> None:
        self.written += bytes(data)

    def close(self) -> None:
        self.closed = True

    def is_closing(self) -> bool:
        return self.closed

    def can_write_eof(self) -> bool:
        return True

    def write_eof(self) -> None:
        pass

    def pause_reading(self) -> None:
        pass

    def resume_reading(self) -> None:
        pass

    def get_protocol(self) -> asyncio.BaseProtocol:
        assert self.protocol is not None
        return self.protocol


async def _served(*reads: bytes, answers: int) -> bytes:
    """What the gateway's protocol writes when the client's bytes arrive in ``reads``, once it
    has begun ``answers`` responses (10 s at most)."""
    protocol = BoundedHttpTools(
        config=Config(app=_app, lifespan="off"), server_state=ServerState(), app_state={}
    )
    transport = _Transport()
    transport.protocol = protocol
    protocol.connection_made(transport)
    for data in reads:
        protocol.data_received(data)
        await asyncio.sleep(0.01)  # the app may answer what is whole before the next read
    deadline = asyncio.get_running_loop().time() + 10
    while transport.written.count(b"HTTP/1.1 ") < answers or not transport.written.endswith(
        (b"0", b"}")  # the last answer's body: a length, or an error envelope
    ):
        assert asyncio.get_running_loop().time() < deadline, transport.written
        await asyncio.sleep(0.01)
    protocol.connection_lost(None)
    return transport.written


def test_a_body_read_with_the_start_of_the_next_head_does_not_count_as_head() -> None:
    """A pipelining client: a POST with a body past ``MAX_HEAD_BYTES``, and in the same read
    the first line of the next request, whose head ends in the next read. Only that line is
    head: both requests are served."""
    body = b"a" * (2 * MAX_HEAD_BYTES)
    post = b"POST /up HTTP/1.1\r\nHost: x\r\nContent-Length: %d\r\n\r\n" % len(body)
    written = asyncio.run(
        _served(post + body + b"GET /next HTTP/1.1\r\n", b"Host: x\r\n\r\n", answers=2)
    )
    assert b"431" not in written, written
    assert written.count(b"HTTP/1.1 200 OK") == 2, written
    assert written.endswith(b"\r\n\r\n0"), written  # the GET, read with no body


def _refused_after_one_answer(written: bytes, first_body: bytes) -> None:
    """The first request answered (its body's length), then 431 for the second."""
    first, _, rest = written.partition(b"HTTP/1.1 431 ")
    assert first.startswith(b"HTTP/1.1 200 OK") and first.endswith(first_body), written
    assert b"headers_too_large" in rest, written


def test_a_head_past_the_bound_after_a_body_in_the_same_read_is_still_refused() -> None:
    """One read: a POST and its body, then a head larger than the bound by itself that has
    not ended: refused (431) as it stands, after the first request is answered."""
    body = b"a" * 1000
    post = b"POST /up HTTP/1.1\r\nHost: x\r\nContent-Length: %d\r\n\r\n" % len(body)
    padding = b"X-Padding: " + b"p" * MAX_HEAD_BYTES + b"\r\n"
    _refused_after_one_answer(
        asyncio.run(_served(post + body + b"GET /next HTTP/1.1\r\n" + padding, answers=2)),
        b"1000",
    )


def test_a_field_carried_over_from_an_earlier_read_is_not_taken_off_the_next_head() -> None:
    """httptools hands a head field over whole when it ends, so a large field of the first
    request begun in the read before is handed over in the read that also starts the next
    request: it came mostly in the earlier read, and the next head, past the bound in this
    read alone, is still refused before it ends."""
    first = b"POST /up HTTP/1.1\r\nContent-Length: 0\r\nX-Big: " + b"b" * (MAX_HEAD_BYTES - 100)
    second = b"GET /next HTTP/1.1\r\nX-Big: " + b"c" * MAX_HEAD_BYTES
    _refused_after_one_answer(asyncio.run(_served(first, b"\r\n\r\n" + second, answers=2)), b"0")


def test_a_gateway_with_a_dsn_serves_each_request_in_an_error_scope_of_its_own(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """With ``SENTRY_DSN`` set the gateway initialises the SDK without the integrations that
    wrap every request (``contracts.telemetry``) and serves each request inside
    ``ErrorScope``, outermost, so a request's tags and its escaping errors stay its own
    (``tests/contracts/test_telemetry.py`` shows the scope at work); without a DSN neither."""
    import sentry_sdk

    from gateway.app import create_app
    from gateway.config import GatewaySettings
    from gateway.error_scope import ErrorScope

    inits: list[dict[str, Any]] = []
    monkeypatch.setattr(sentry_sdk, "init", lambda **options: inits.append(options))
    app = create_app(GatewaySettings(sentry_dsn="https://key@sentry.invalid/1"))
    assert app.user_middleware[0].cls is ErrorScope
    assert len(inits) == 1 and inits[0]["auto_enabling_integrations"] is False
    without = create_app(GatewaySettings())
    assert ErrorScope not in [middleware.cls for middleware in without.user_middleware]
    assert len(inits) == 1
