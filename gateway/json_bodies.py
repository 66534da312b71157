"""Who asks, then what they sent: a POST to a route that reads a body is 401 without a tenant
key before a byte of its body is read; with one, every JSON body is strict JSON
(``contracts.strict_json``) before the route sees it, so a route's own parse (FastAPI's) only
ever meets valid, shallow JSON. Elsewhere the app answers (404, 405), whatever the body."""

from __future__ import annotations

from typing import Any

from fastapi.security.utils import get_authorization_scheme_param
from starlette.concurrency import run_in_threadpool
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from contracts.errors import ErrorBody, ErrorCode
from contracts.strict_json import JsonRefusal, loads
from contracts.tenants import KEY_PREFIX
from gateway.access import refused
from gateway.errors import error_response, shown

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


JSONL_TYPES = ("application/jsonl", "application/x-ndjson", "application/jsonlines")

_BODY_TYPES: dict[str, tuple[str, ...]] = {
    "/v1/jobs": (),
    "/v1/completions": (),
    "/v1/chat/completions": (),
    "/v1/batches": JSONL_TYPES,
}
"""Routes whose body is JSON -> the other media types they read."""

_KEYED_BODIES = frozenset((*_BODY_TYPES, "/v1/files"))
"""The routes that read a body (each needs a tenant key): without one, 401 before reading it."""


def _header(scope: Scope, name: bytes) -> bytes:
    """The first of the request's headers named ``name`` (as Starlette's ``headers.get``,
    which the routes read, picks a header sent twice), or empty."""
    return next((value for key, value in scope["headers"] if key == name), b"")


def _media_type(scope: Scope) -> str:
    raw = _header(scope, b"content-type")
    return raw.split(b";")[0].strip().lower().decode("latin-1")


def is_json(media_type: str) -> bool:
    """Does FastAPI read a body of this media type (``_media_type``) as JSON (a JSON media
    type, or none)?"""
    return media_type in ("", "application/json") or media_type.endswith("+json")


def _presents_a_key(scope: Scope) -> bool:
    """Does the request carry a bearer credential shaped like a tenant key? (Whether it is
    one is the route's check, in Redis.)"""
    # Split as the routes' ``HTTPBearer`` splits it (the credential stripped).
    value = _header(scope, b"authorization").decode("latin-1")
    scheme, credential = get_authorization_scheme_param(value)
    return scheme.lower() == "bearer" and credential.startswith(KEY_PREFIX)


class StrictJsonBodies:
    """On the routes that read a body: 401 without a key, unread; 415 for a media type the
    route does not read; 422 ``validation_error`` for a JSON body that is not strict JSON,
    before the route reads it. The body is already bounded (``BodyLimit`` runs first)."""

    def __init__(self, app: ASGIApp) -> None:
        self._app = app

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        # Only the routes that read a body: elsewhere the path (404) or the method (405) is
        # what is wrong, whatever the body, and the app says so.
        path = scope["path"] if scope["type"] == "http" and scope["method"] == "POST" else None
        if path not in _KEYED_BODIES:
            await self._app(scope, receive, send)
            return
        if not _presents_a_key(scope):
            # Who asks comes first, and an anonymous body costs nothing: it is never read
            # (nor waited for), and the connection closes with the answer.
            await _unauthorized(scope, receive, send)
            return
        others = _BODY_TYPES.get(path)
        if others is None:
            await self._app(scope, receive, send)
            return
        media_type = _media_type(scope)
        if not is_json(media_type):
            if media_type not in others:
                await _refuse(scope, receive, send, 415, _not_json(media_type, others))
                return
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
                refusal = ErrorBody(
                    code=ErrorCode.VALIDATION_ERROR,
                    message=f"Invalid request: body: {exc}. Nothing was enqueued.",
                )
                await _refuse(scope, receive, send, 422, refusal)
                return
        replayed = False

        async def replay() -> Message:
            nonlocal replayed
            if not replayed:
                replayed = True
                return {"type": "http.request", "body": body, "more_body": False}
            return await receive()

        await self._app(scope, replay, send)


def _not_json(media_type: str, others: tuple[str, ...]) -> ErrorBody:
    accepted = " or ".join(("application/json", *others))
    return ErrorBody(
        code=ErrorCode.UNSUPPORTED_MEDIA_TYPE,
        message=f"The body must be sent as Content-Type: {accepted}, not {shown(media_type)} "
        "(curl -d sends application/x-www-form-urlencoded: add -H 'Content-Type: "
        "application/json'). Nothing was enqueued.",
    )


async def _refuse(scope: Scope, receive: Receive, send: Send, status: int, body: ErrorBody) -> None:
    """Answer a body this middleware will not pass on (the request presents a key)."""
    await error_response(status, body, param="body")(scope, receive, send)


async def _unauthorized(scope: Scope, receive: Receive, send: Send) -> None:
    """401, as the routes' key check answers a request without a key; the connection closes
    (its body is never read)."""
    denied = refused()
    body = ErrorBody(code=denied.code, message=denied.message)
    headers = {**(denied.headers or {}), "Connection": "close"}
    await error_response(401, body, headers=headers)(scope, receive, send)
