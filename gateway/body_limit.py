"""Refuse request bodies over a size limit (413) before reading them whole.

A declared ``Content-Length`` over the limit is refused before a byte of the body is read; a
chunked body is counted as it arrives and refused as soon as it passes the limit.
"""

from __future__ import annotations

from starlette.types import ASGIApp, Message, Receive, Scope, Send

from contracts.errors import ErrorBody, ErrorCode
from gateway.errors import error_response


class BodyLimit:
    def __init__(self, app: ASGIApp, max_bytes: int, larger: dict[str, int] | None = None) -> None:
        self._app = app
        self._max_bytes = max_bytes
        self._larger = larger or {}

    @staticmethod
    def _refusal(limit: int) -> ErrorBody:
        return ErrorBody(
            code=ErrorCode.PAYLOAD_TOO_LARGE,
            message=f"The request body is larger than {limit} bytes; the request was refused "
            "unread (nothing was stored or enqueued).",
        )

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self._app(scope, receive, send)
            return
        limit = self._larger.get(scope["path"], self._max_bytes)
        declared = dict(scope["headers"]).get(b"content-length")
        if declared is not None and declared.isdigit() and int(declared) > limit:
            await error_response(413, self._refusal(limit))(scope, receive, send)
            return
        seen = 0
        refused = started = False

        async def counted() -> Message:
            # Over the limit: answer 413 now and tell the app the client left, so it stops
            # reading; whatever it answers after that is dropped.
            nonlocal seen, refused
            if seen > limit:
                return {"type": "http.disconnect"}
            message = await receive()
            if message["type"] == "http.request":
                seen += len(message.get("body", b""))
                if seen > limit:
                    if not started:
                        refused = True
                        await error_response(413, self._refusal(limit))(scope, receive, send)
                    return {"type": "http.disconnect"}
            return message

        async def unless_refused(message: Message) -> None:
            nonlocal started
            if not refused:
                started = True
                await send(message)

        await self._app(scope, counted, unless_refused)
