"""uvicorn's httptools protocol with a bound on each request's head, as h11 has.

httptools (llhttp) is the faster of uvicorn's two HTTP parsers, but it keeps whatever request
line and headers a client sends until they end: nothing bounds them (h11, the other, refuses a
head over 16 KiB). A client without a key could make the gateway hold megabytes a connection
before any route or middleware runs. This protocol counts the bytes a request's head takes as
they arrive and, once they pass ``MAX_HEAD_BYTES``, answers 431 ``headers_too_large`` and
closes the connection; the parser has then buffered at most that plus one read. A body does not
count: the count stops when the head is complete and starts again with the next request (in a
read that holds the end of one request and the start of the next, only what follows the bytes
the parser handed over for the first counts: its body, URL, and head fields if it began in that
read; its request line, a field begun in an earlier read, and a chunked body's size lines
count as head, so a pipelining client that sends a chunked body in many tiny chunks can meet
a 431 early, never a head past the bound). A head
that arrives whole within one read (so never left incomplete to be counted) is measured as the
parser hands it over (its request target and headers) and refused the same, never run.

The close lingers, as nginx's does: the answer is followed by the end of the gateway's side
(the client reads it, then the end), and what the client still sends is read and dropped for
up to ``LINGER_S`` before the connection is closed. Closing at once, with the rest of the head
unread, would reset the connection, and a client could lose the answer with it.

A head must also arrive in time (``LORAFLEET_HEAD_TIMEOUT_S``): uvicorn bounds only the idle
time between a response and the next request (keep-alive), and that only until a byte arrives
(a stray CRLF is enough), so a client that opens connections and sends nothing, or a head a byte
at a time, holds each connection (and a file descriptor) for ever. Here, between requests, the
first byte starts the head's clock: the head must be whole within the bound, or the answer is
408 ``header_timeout`` and the connection is closed as above (closed without an answer when no
head began: only line ends came). A new connection that sends nothing is closed after the
keep-alive time or the head's bound, whichever is longer, as an idle kept-alive one would be.
Unlike the body's bound (between pieces, ``gateway.body_limit``), this one is on the whole head,
as nginx's ``client_header_timeout``: a head is small, and a client that trickles it is not a
client. Bytes that arrive while a response is still being sent (a pipelining client) start no
clock: the keep-alive timer, armed when that response ends, bounds them as it bounds silence.
(Bytes between requests that are not a head, the rest of a body the app answered without
reading, start the clock too, and end in a close without an answer.) This protocol writes
nothing into a response in flight: a head refused then (431) is answered once the responses
before it are sent. Bytes the parser cannot read as a head (a field without a colon, TLS sent
to this plain-text port, a target uvicorn's URL parser refuses) are refused the same way, 400
``malformed_request``; in the body of a request still being answered (a chunked body's framing)
they get uvicorn's own 400, which is not held back so.

The web command names it: ``uvicorn ... --http gateway.http_protocol:BoundedHttpTools``.
"""

from __future__ import annotations

import asyncio
import logging
from typing import Any

from uvicorn.protocols.http.httptools_impl import HttpToolsProtocol

from contracts.errors import ErrorCode
from gateway.config import GatewaySettings
from gateway.errors import ErrorEnvelope, ErrorEnvelopeBody, error_type, status_of

log = logging.getLogger(__name__)

MAX_HEAD_BYTES = 16 * 1024
"""The request line and headers of one request, in bytes (h11's bound, nginx's default
``large_client_header_buffers`` is 4 x 8 KiB)."""

HEAD_TIMEOUT_S = float(GatewaySettings.model_fields["head_timeout_s"].default)
"""A head's time to arrive where the app names none (the settings' default)."""

LINGER_S = 2.0
"""How long a refused client's further bytes are read and dropped before the close."""


def _answer(code: ErrorCode, reason: str, message: str) -> bytes:
    """A whole HTTP/1.1 answer carrying ``code``'s error envelope, closing the connection."""
    status = status_of(code)
    envelope = ErrorEnvelope(
        error=ErrorEnvelopeBody(code=code, message=message, type=error_type(status))
    )
    body = envelope.model_dump_json(exclude_none=True).encode()
    head = (
        f"HTTP/1.1 {status} {reason}\r\n"
        "content-type: application/json\r\n"
        f"content-length: {len(body)}\r\n"
        "connection: close\r\n\r\n"
    )
    return head.encode("ascii") + body


_TOO_LARGE = _answer(
    ErrorCode.HEADERS_TOO_LARGE,
    "Request Header Fields Too Large",
    f"The request line and headers are larger than {MAX_HEAD_BYTES} bytes; the request was "
    "refused unread (nothing was stored or enqueued).",
)


_MALFORMED = _answer(
    ErrorCode.MALFORMED_REQUEST,
    "Bad Request",
    "The request is not HTTP/1.1 this server can read (its request line or a header field is "
    "malformed, or it is not HTTP at all: TLS sent to a plain-text port?); it was refused "
    "unread (nothing was stored or enqueued).",
)


def _late(timeout_s: float) -> bytes:
    return _answer(
        ErrorCode.HEADER_TIMEOUT,
        "Request Timeout",
        f"The request line and headers did not arrive whole within {timeout_s:g} s; the "
        "request was refused unread (nothing was stored or enqueued). Send the head at once.",
    )


def _head_timeout_of(app: Any) -> float:
    """``head_timeout_s`` of the gateway app under uvicorn's wrappers (``create_app`` puts it in
    the app's state); the settings' default for any other app."""
    while app is not None:
        timeout_s = getattr(getattr(app, "state", None), "head_timeout_s", None)
        if timeout_s is not None:
            return float(timeout_s)
        app = getattr(app, "app", None)
    return HEAD_TIMEOUT_S


class BoundedHttpTools(HttpToolsProtocol):
    """``HttpToolsProtocol``, refusing a request whose head passes ``MAX_HEAD_BYTES`` or does
    not arrive within the app's ``head_timeout_s``."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self._in_head = False
        self._head_bytes = 0
        self._parsed_head = 0  # the head's request target and headers, as the parser gave them
        self._handed_over = 0  # bytes of the read being parsed the parser handed over so far
        self._head_from: int | None = None  # ``_handed_over`` when a head began in this read
        self._refused = False  # from then on, what the client sends is dropped unread
        self._answer_due: bytes | None = None  # a refusal held until the responses are sent
        self._lingering: asyncio.TimerHandle | None = None
        self._head_timeout_s = _head_timeout_of(self.app)
        self._timer: asyncio.TimerHandle | None = None
        self._timing_head = False  # the timer bounds a head begun (else: a silent connection)

    def connection_made(self, transport: asyncio.Transport) -> None:  # type: ignore[override]
        super().connection_made(transport)
        idle_s = max(self._head_timeout_s, float(self.timeout_keep_alive))
        self._timer = self.loop.call_later(idle_s, self._timed_out)

    def on_message_begin(self) -> None:
        super().on_message_begin()
        self._in_head = True
        self._head_bytes = 0
        self._parsed_head = 0
        self._head_from = self._handed_over

    def on_url(self, url: bytes) -> None:
        self._parsed_head += len(url)
        self._handed_over += len(url)  # the URL comes in the pieces each read holds
        super().on_url(url)

    def on_header(self, name: bytes, value: bytes) -> None:
        self._parsed_head += len(name) + len(value) + 4  # ": " and the line's end
        if self._head_from is not None:
            # Its request began in this read, so the whole field is in it (httptools hands a
            # field over whole, when it ends: one begun in an earlier read was counted there),
            # at least ``name:value`` and the line's end.
            self._handed_over += len(name) + len(value) + 3
        super().on_header(name, value)

    def on_headers_complete(self) -> None:
        self._stop_timer()
        if self._refused:
            self._in_head = False
            return  # a request pipelined behind a refused one, in the same read: never run
        # A head that came whole within one read was never counted by ``data_received``
        # (which sees only heads still incomplete after a read): its parsed size decides.
        line = len(self.parser.get_method()) + len(b"  HTTP/1.1\r\n\r\n")
        if self._parsed_head + line > MAX_HEAD_BYTES:
            self._refuse_too_large()
            return
        # Still in the head while uvicorn reads it: its URL parser refuses targets llhttp
        # took (``http://[::1``), and that refusal is a malformed head (``send_400_response``).
        super().on_headers_complete()
        self._in_head = False

    def on_body(self, body: bytes) -> None:
        self._handed_over += len(body)
        if not self._refused:  # else the body of a refused request: dropped
            super().on_body(body)

    def on_message_complete(self) -> None:
        if not self._refused:
            super().on_message_complete()

    def data_received(self, data: bytes) -> None:
        if self._refused:
            return  # dropped until the client closes, LINGER_S passed, or the responses end
        self._handed_over, self._head_from = 0, None
        super().data_received(data)
        if self._refused:
            return  # refused while this read was parsed (a head whole in it, too large)
        if self.transport.is_closing() or self.transport.get_protocol() is not self:
            return  # closed, or upgraded (handed to another protocol)
        if not self._timing_head and self._between_requests():
            # The first bytes since the last response ended (or since the opening), and no
            # head is whole yet: it is due within the bound from now.
            self._stop_timer()
            self._timing_head = True
            self._timer = self.loop.call_later(self._head_timeout_s, self._timed_out)
        if not self._in_head:
            return
        # The head is not complete after this read: all of the read was head, or, if the head
        # began in it, what followed the earlier request's bytes the parser handed over (body,
        # URL, and its head fields if it began in this read too). The rest of it (its request
        # line, fields begun in an earlier read, a chunked body's framing) counts as head:
        # the count errs towards a refusal, never past the bound.
        self._head_bytes += max(0, len(data) - (self._head_from or 0))
        if self._head_bytes > MAX_HEAD_BYTES:
            self._refuse_too_large()

    def _between_requests(self) -> bool:
        """No response is being sent or waits its turn: what arrives now is a next head."""
        return not self.pipeline and (self.cycle is None or self.cycle.response_complete)

    def _timed_out(self) -> None:
        self._timer = None
        timing_head, self._timing_head = self._timing_head, False
        if self._refused or self.transport.is_closing():
            return
        if not self._between_requests():  # a head completed meanwhile: nothing to bound
            return
        if not (timing_head and self._in_head):  # silent, or only line ends: nobody to answer
            self.transport.close()
            return
        log.warning("request head not whole within %g s refused", self._head_timeout_s)
        self._refuse(_late(self._head_timeout_s))

    def _refuse_too_large(self) -> None:
        log.warning("request head over %d bytes refused", MAX_HEAD_BYTES)
        self._refuse(_TOO_LARGE)

    def _refuse(self, answer: bytes) -> None:
        """Refuse the head being read: what the client sends from now on is dropped, and
        ``answer`` goes out once no response is being sent (at once, or after those in flight:
        never into one), followed by the end of the gateway's side and the close."""
        self._refused = True
        self._in_head = False
        self._stop_timer()
        if self._between_requests():
            self._answer(answer)
        else:
            self._answer_due = answer

    def on_response_complete(self) -> None:
        super().on_response_complete()
        if (
            self._answer_due is not None
            and self._between_requests()
            and not self.transport.is_closing()
        ):
            answer, self._answer_due = self._answer_due, None
            self._answer(answer)

    def _answer(self, answer: bytes) -> None:
        """Write ``answer``, end the gateway's side, and read and drop what the client still
        sends until it closes or ``LINGER_S`` passed."""
        self.transport.write(answer)
        if self.transport.can_write_eof():
            self.transport.write_eof()
        self._lingering = self.loop.call_later(LINGER_S, self.transport.close)

    def send_400_response(self, msg: str) -> None:
        """The parser could not read what came (uvicorn has logged it): a head is refused as
        a head past the bound is (the envelope, after any response in flight, then the
        lingering close); bytes inside a request's body (a chunked body's framing) are left
        to uvicorn's own answer, which closes the connection under the running request."""
        if self._refused:
            return  # answered already (a head too large, whole in the read being parsed)
        if self._in_head or self._between_requests():
            self._refuse(_MALFORMED)
            return
        super().send_400_response(msg)

    def _stop_timer(self) -> None:
        if self._timer is not None:
            self._timer.cancel()
            self._timer = None
        self._timing_head = False

    def connection_lost(self, exc: Exception | None) -> None:
        if self._lingering is not None:
            self._lingering.cancel()
        self._stop_timer()
        super().connection_lost(exc)
