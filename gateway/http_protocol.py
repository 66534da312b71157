"""uvicorn's httptools protocol with a bound on each request's head, as h11 has.

httptools (llhttp) is the faster of uvicorn's two HTTP parsers, but it keeps whatever request
line and headers a client sends until they end: nothing bounds them (h11, the other, refuses a
head over 16 KiB). A client without a key could make the gateway hold megabytes a connection
before any route or middleware runs. This protocol counts the bytes a request's head takes as
they arrive and, once they pass ``MAX_HEAD_BYTES``, answers 431 ``headers_too_large`` and
closes the connection; the parser has then buffered at most that plus one read. A body does not
count: the count stops when the head is complete and starts again with the next request.

The close lingers, as nginx's does: the answer is followed by the end of the gateway's side
(the client reads it, then the end), and what the client still sends is read and dropped for
up to ``LINGER_S`` before the connection is closed. Closing at once, with the rest of the head
unread, would reset the connection, and a client could lose the answer with it.

The web command names it: ``uvicorn ... --http gateway.http_protocol:BoundedHttpTools``.
"""

from __future__ import annotations

import asyncio
import logging
from typing import Any

from uvicorn.protocols.http.httptools_impl import HttpToolsProtocol

from contracts.errors import ErrorCode
from gateway.errors import ErrorEnvelope, ErrorEnvelopeBody, error_type, status_of

log = logging.getLogger(__name__)

MAX_HEAD_BYTES = 16 * 1024
"""The request line and headers of one request, in bytes (h11's bound, nginx's default
``large_client_header_buffers`` is 4 x 8 KiB)."""

LINGER_S = 2.0
"""How long a refused client's further bytes are read and dropped before the close."""

_STATUS = status_of(ErrorCode.HEADERS_TOO_LARGE)


def _refusal() -> bytes:
    envelope = ErrorEnvelope(
        error=ErrorEnvelopeBody(
            code=ErrorCode.HEADERS_TOO_LARGE,
            message=f"The request line and headers are larger than {MAX_HEAD_BYTES} bytes; "
            "the request was refused unread (nothing was stored or enqueued).",
            type=error_type(_STATUS),
        )
    )
    body = envelope.model_dump_json(exclude_none=True).encode()
    head = (
        f"HTTP/1.1 {_STATUS} Request Header Fields Too Large\r\n"
        "content-type: application/json\r\n"
        f"content-length: {len(body)}\r\n"
        "connection: close\r\n\r\n"
    )
    return head.encode("ascii") + body


class BoundedHttpTools(HttpToolsProtocol):
    """``HttpToolsProtocol``, refusing a request whose head passes ``MAX_HEAD_BYTES``."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self._in_head = False
        self._head_bytes = 0
        self._lingering: asyncio.TimerHandle | None = None

    def on_message_begin(self) -> None:
        super().on_message_begin()
        self._in_head = True
        self._head_bytes = 0

    def on_headers_complete(self) -> None:
        self._in_head = False
        super().on_headers_complete()

    def data_received(self, data: bytes) -> None:
        if self._lingering is not None:
            return  # refused: read and dropped until the client closes, or LINGER_S passed
        super().data_received(data)
        if not self._in_head or self.transport.is_closing():
            return
        # The head is not complete after this read: all of it was head (a read that began a
        # request after the end of the last one counts whole, at most one read too many).
        self._head_bytes += len(data)
        if self._head_bytes > MAX_HEAD_BYTES:
            log.warning("request head over %d bytes refused", MAX_HEAD_BYTES)
            self._in_head = False
            self.transport.write(_refusal())
            if self.transport.can_write_eof():
                self.transport.write_eof()
            self._lingering = asyncio.get_running_loop().call_later(LINGER_S, self.transport.close)

    def connection_lost(self, exc: Exception | None) -> None:
        if self._lingering is not None:
            self._lingering.cancel()
        super().connection_lost(exc)
