"""Each request in a Sentry scope of its own (installed when ``SENTRY_DSN`` is set).

sentry-sdk's Starlette and FastAPI integrations did this, with a transaction, spans and the
request's data for every request; they are not enabled (``contracts.telemetry``: with a DSN
the gateway spent about 30% more CPU per request, all of it theirs). What errors need of them is
kept: the
tags a request sets (its tenant, adapter and revision) stay its own, never another request's
running at the same time, and an exception that escapes the app is reported tagged, with the
request's method and path.
"""

from __future__ import annotations

import sentry_sdk
from starlette.types import ASGIApp, Receive, Scope, Send

from contracts.telemetry import error_scope


class ErrorScope:
    def __init__(self, app: ASGIApp) -> None:
        self._app = app

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self._app(scope, receive, send)
            return
        with error_scope():
            # As sent (percent-encoded: no line ends), without the query; Sentry keeps tag
            # values of up to 200 characters.
            path = scope.get("raw_path") or scope["path"].encode()
            path = path.partition(b"?")[0].decode("ascii", "replace")[:200]
            sentry_sdk.set_tags({"http.method": scope["method"], "http.path": path})
            await self._app(scope, receive, send)
