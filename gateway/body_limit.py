"""Refuse request bodies over a size limit (413) before reading them whole, and bodies that
stop arriving (408).

A declared ``Content-Length`` over the limit is refused before a byte of the body is read; a
chunked body is counted as it arrives and refused as soon as it passes the limit. While a body
is not whole, each next piece must come within ``timeout_s``: a client that declares a body and
stops sending it would otherwise hold its connection (and a coroutine) for ever. Once the body
is whole, the app's further reads (it listens for the client leaving) wait without a bound.
"""

from __future__ import annotations

import asyncio

from starlette.types import ASGIApp, Message, Receive, Scope, Send

from contracts.errors import ErrorBody, ErrorCode
from gateway.errors import error_response


class BodyLimit:
    def __init__(
        self,
        app: ASGIApp,
        max_bytes: int,
        timeout_s: float,
        larger: dict[str, int] | None = None,
    ) -> None:
        self._app = app
        self._max_bytes = max_bytes
        self._timeout_s = timeout_s
        self._larger = larger or {}

    @staticmethod
    def _refusal(limit: int) -> ErrorBody:
        return ErrorBody(
            code=ErrorCode.PAYLOAD_TOO_LARGE,
            message=f"The request body is larger than {limit} bytes; the request was refused "
            "unread (nothing was stored or enqueued).",
        )

    def _stalled(self) -> ErrorBody:
        return ErrorBody(
            code=ErrorCode.BODY_TIMEOUT,
            message=f"The request body stopped arriving: no part of it came for "
            f"{self._timeout_s:g} s. The request was not served (nothing was stored or "
            "enqueued); send the whole body.",
        )

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self._app(scope, receive, send)
            return
        limit = self._larger.get(scope["path"], self._max_bytes)
        headers = dict(scope["headers"])
        declared = headers.get(b"content-length")
        if declared is not None and declared.isdigit() and int(declared) > limit:
            # Closed with the answer: the body is never read (nor taken in after it).
            refusal = error_response(413, self._refusal(limit), headers={"Connection": "close"})
            await refusal(scope, receive, send)
            return
        # A body is coming: an answer sent before it is whole (404, 405, a 401 from a route's
        # key check) closes the connection, so its rest is not waited for or read.
        has_body = (declared is not None and declared != b"0") or b"transfer-encoding" in headers
        seen = 0
        refused = started = whole = False

        async def refuse(status: int, body: ErrorBody) -> Message:
            # Answer now and tell the app the client left, so it stops reading; whatever it
            # answers after that is dropped.
            nonlocal refused
            if not started and not refused:
                refused = True
                # Closed right after the answer: the rest of the body is never read, and a
                # kept-alive connection would be held until the keep-alive timer.
                response = error_response(status, body, headers={"Connection": "close"})
                await response(scope, receive, send)
            return {"type": "http.disconnect"}

        async def counted() -> Message:
            nonlocal seen, whole
            if refused or seen > limit:
                return {"type": "http.disconnect"}
            if whole:
                return await receive()
            try:
                message = await asyncio.wait_for(receive(), self._timeout_s)
            except TimeoutError:
                return await refuse(408, self._stalled())
            if message["type"] == "http.request":
                whole = not message.get("more_body", False)
                seen += len(message.get("body", b""))
                if seen > limit:
                    return await refuse(413, self._refusal(limit))
            return message

        async def unless_refused(message: Message) -> None:
            nonlocal started
            if not refused:
                if message["type"] == "http.response.start" and has_body and not whole:
                    message = {
                        **message,
                        "headers": [
                            *(
                                h
                                for h in message.get("headers", [])
                                if h[0].lower() != b"connection"
                            ),
                            (b"connection", b"close"),
                        ],
                    }
                started = True
                await send(message)

        await self._app(scope, counted, unless_refused)
