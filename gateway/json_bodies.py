"""Every JSON request body is strict JSON (``contracts.strict_json``) before a route sees it:
a route's own parse (FastAPI's) then only ever meets valid, shallow JSON."""

from __future__ import annotations

from typing import Any

from starlette.concurrency import run_in_threadpool
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from contracts.errors import ErrorBody, ErrorCode
from contracts.strict_json import JsonRefusal, loads
from contracts.tenants import KEY_PREFIX
from gateway.access import refused
from gateway.errors import error_response

THREAD_ABOVE_BYTES = 64 * 1024
"""Bodies larger than this are parsed in a worker thread, off the event loop."""

PARSED = "lorafleet.json_body"
"""``request.state`` entry holding the body as this middleware parsed it (routes' own
dependencies read fields from it before FastAPI validates the body)."""


async def loads_off_loop(raw: bytes) -> Any:
    """``loads``, in a worker thread when ``raw`` is large enough to stall the event loop."""
    if len(raw) > THREAD_ABOVE_BYTES:
        return await run_in_threadpool(loads, raw)
    return loads(raw)


def is_json(scope: Scope) -> bool:
    """Does FastAPI read this request's body as JSON (a JSON content type, or none)?"""
    headers = dict(scope["headers"])
    content_type = headers.get(b"content-type", b"").split(b";")[0].strip().lower()
    return content_type in (b"", b"application/json") or content_type.endswith(b"+json")


def _presents_a_key(scope: Scope) -> bool:
    """Does the request carry a bearer credential shaped like a tenant key? (Whether it is
    one is the route's check, in Redis.)"""
    value = dict(scope["headers"]).get(b"authorization", b"").decode("latin-1")
    scheme, _, credential = value.partition(" ")
    return scheme.lower() == "bearer" and credential.startswith(KEY_PREFIX)


class StrictJsonBodies:
    """Refuse a JSON request body that is not strict JSON (422 ``validation_error``) before
    the route reads it. The body is already bounded (``BodyLimit`` runs first)."""

    def __init__(self, app: ASGIApp) -> None:
        self._app = app

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http" or scope["method"] not in ("POST", "PUT", "PATCH"):
            await self._app(scope, receive, send)
            return
        if not is_json(scope):
            await self._app(scope, receive, send)
            return
        chunks: list[bytes] = []
        while True:
            message = await receive()
            if message["type"] == "http.disconnect":
                return
            chunks.append(message.get("body", b""))
            if not message.get("more_body", False):
                break
        body = b"".join(chunks)
        if body:
            try:
                scope.setdefault("state", {})[PARSED] = await loads_off_loop(body)
            except JsonRefusal as exc:
                if not _presents_a_key(scope):
                    # Who is asking comes first: without a key the answer is 401, as it is
                    # for a readable body (the routes' key check runs before their body's).
                    denied = refused()
                    body_of = ErrorBody(code=denied.code, message=denied.message)
                    response = error_response(401, body_of, headers=denied.headers)
                    await response(scope, receive, send)
                    return
                refusal = ErrorBody(
                    code=ErrorCode.VALIDATION_ERROR,
                    message=f"Invalid request: body: {exc}. Nothing was enqueued.",
                )
                await error_response(422, refusal, param="body")(scope, receive, send)
                return
        replayed = False

        async def replay() -> Message:
            nonlocal replayed
            if not replayed:
                replayed = True
                return {"type": "http.request", "body": body, "more_body": False}
            return await receive()

        await self._app(scope, replay, send)
