"""Typed API errors: each carries an HTTP status, a stable code and a human sentence.

Every error answers ``{"error": {"code", "message", "type", "param", "details"?}}``: our
stable ``code`` and sentence inside OpenAI's error envelope, so OpenAI clients raise their
usual exception types and our own clients branch on ``code``.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any, Protocol

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from pydantic import BaseModel, ValidationError
from starlette.exceptions import HTTPException

from contracts.errors import ErrorBody, ErrorCode

RETRY_AFTER_S = 2
"""``Retry-After`` of a 503: long enough for a Redis failover or restart to finish."""

_TYPES = {
    400: "invalid_request_error",
    401: "authentication_error",
    403: "permission_error",
    404: "not_found_error",
    405: "invalid_request_error",
    409: "conflict_error",
    410: "not_found_error",
    413: "invalid_request_error",
    431: "invalid_request_error",
    422: "invalid_request_error",
    429: "rate_limit_error",
    503: "service_unavailable_error",
    504: "timeout_error",
}


SHOWN_ID_CHARS = 80
"""How much of an id a caller sent an error message echoes (no id is longer)."""


def shown(value: object) -> str:
    """``value``, sent by a caller, as an error message quotes it: ``repr``, cut after
    ``SHOWN_ID_CHARS`` (a name or a value can be as long as the body that carried it)."""
    if isinstance(value, str):
        if len(value) <= SHOWN_ID_CHARS:
            return repr(value)
        return f"{value[:SHOWN_ID_CHARS]!r}... ({len(value)} characters)"
    text = repr(value)
    if len(text) <= SHOWN_ID_CHARS:
        return text
    return f"{text[:SHOWN_ID_CHARS]}... ({len(text)} characters)"


def cut(name: str) -> str:
    """A caller-chosen name (a field, a parameter) cut after ``SHOWN_ID_CHARS``, unquoted."""
    return name if len(name) <= SHOWN_ID_CHARS else f"{name[:SHOWN_ID_CHARS]}..."


def error_type(status_code: int) -> str:
    """OpenAI's error ``type`` for an HTTP status."""
    return _TYPES.get(status_code, "server_error" if status_code >= 500 else "api_error")


class ErrorEnvelopeBody(ErrorBody):
    type: str
    param: str | None = None


class ErrorEnvelope(BaseModel):
    """Body of every error answer."""

    error: ErrorEnvelopeBody


class ApiError(Exception):
    """An error answered to the caller in the error envelope."""

    def __init__(
        self,
        status_code: int,
        code: ErrorCode,
        message: str,
        headers: dict[str, str] | None = None,
        param: str | None = None,
        details: list[dict[str, object]] | None = None,
    ) -> None:
        super().__init__(message)
        self.status_code = status_code
        self.code = code
        self.message = message
        self.headers = headers
        self.param = param
        self.details = details


NOT_ADMITTED = "The job was not accepted: {what} ({exc}). Nothing was enqueued; retry."


# Within the bound, a burst queues for connections and CPU as well as for Redis itself.
ADMISSION_TIMED_OUT = (
    "Redis or the queue did not answer within the admission bound or refused the write (full), "
    "or this gateway is overloaded"
)


def unavailable(what: str, exc: BaseException, template: str = NOT_ADMITTED) -> ApiError:
    """503 with ``Retry-After``: a dependency (Redis, the broker) did not answer in time."""
    message = template.format(what=what, exc=type(exc).__name__)
    return ApiError(
        503, ErrorCode.SERVICE_UNAVAILABLE, message, headers={"Retry-After": str(RETRY_AFTER_S)}
    )


def error_response(
    status_code: int,
    body: ErrorBody,
    headers: dict[str, str] | None = None,
    param: str | None = None,
) -> JSONResponse:
    envelope = ErrorEnvelope(
        error=ErrorEnvelopeBody(
            **body.model_dump(),
            type=error_type(status_code),
            param=None if param is None else cut(param),
        )
    )
    content = envelope.model_dump(mode="json")
    if body.details is None:
        del content["error"]["details"]
    return JSONResponse(content, status_code=status_code, headers=headers)


UNCONFIRMED = "unconfirmed_access"
"""``request.state`` attribute: the request's access was recalled, not read, and no admission
has checked it yet (``gateway.access.Unconfirmed``); a client error (4xx) is answered only
once the key is confirmed."""


class _Confirmable(Protocol):
    async def refusal(self) -> ApiError | None: ...


async def _key_refusal(request: Request, status_code: int) -> ApiError | None:
    """The 401 (or 503) to answer instead of a client error (4xx), if the request's recalled
    access has a key that no longer holds (``UNCONFIRMED``). A server error (5xx) is answered
    as it is: it says nothing of the body, and its bound must not be spent twice."""
    if status_code >= 500:
        return None
    pending: _Confirmable | None = getattr(request.state, UNCONFIRMED, None)
    return None if pending is None else await pending.refusal()


def _answer(exc: ApiError) -> JSONResponse:
    body = ErrorBody(code=exc.code, message=exc.message, details=exc.details)
    return error_response(exc.status_code, body, exc.headers, exc.param)


async def _api_error(request: Request, exc: Exception) -> JSONResponse:
    assert isinstance(exc, ApiError)
    return _answer(await _key_refusal(request, exc.status_code) or exc)


def problem(item: Mapping[str, Any], empty: str = "body") -> tuple[str, str]:
    """A pydantic error as (dotted field, message); ``empty`` names a location-less one."""
    field = ".".join(cut(str(part)) for part in item.get("loc", ())) or empty
    return field, str(item.get("msg", "invalid"))


def invalid(exc: ValidationError) -> ApiError:
    """422 ``validation_error`` naming the first problem, as the request handler words it."""
    field, message = problem(exc.errors()[0])
    return ApiError(
        422, ErrorCode.VALIDATION_ERROR, f"Invalid request: {field}: {message}", param=field
    )


async def _validation_error(request: Request, exc: Exception) -> JSONResponse:
    assert isinstance(exc, RequestValidationError)
    refusal = await _key_refusal(request, 422)
    if refusal is not None:
        return _answer(refusal)
    details: list[dict[str, object]] = []
    for item in exc.errors():
        inside = {**item, "loc": [part for part in item.get("loc", ()) if part != "body"]}
        field, message = problem(inside)
        details.append({"field": field, "message": message})
    first = details[0] if details else {"field": "body", "message": "invalid request"}
    message = f"Invalid request: {first['field']}: {first['message']}"
    if len(details) > 1:
        message += f" (and {len(details) - 1} more problem(s))"
    body = ErrorBody(code=ErrorCode.VALIDATION_ERROR, message=message, details=details)
    return error_response(422, body, param=str(first["field"]))


async def _http_error(request: Request, exc: Exception) -> JSONResponse:
    """The framework's own refusals (no such route, wrong method, a body it could not
    parse) in our envelope; any other 4xx it raises is a request we cannot read."""
    assert isinstance(exc, HTTPException)
    refusal = await _key_refusal(request, exc.status_code)
    if refusal is not None:
        return _answer(refusal)
    headers = dict(exc.headers) if exc.headers else None
    if exc.status_code == 404:
        message = f"No route {shown(request.url.path)}; see /openapi.json for the API."
        body = ErrorBody(code=ErrorCode.ROUTE_NOT_FOUND, message=message)
        return error_response(404, body, headers)
    if exc.status_code == 405:
        message = f"{shown(request.method)} is not allowed on {shown(request.url.path)}."
        body = ErrorBody(code=ErrorCode.METHOD_NOT_ALLOWED, message=message)
        return error_response(405, body, headers)
    if exc.status_code == 413:
        body = ErrorBody(code=ErrorCode.PAYLOAD_TOO_LARGE, message=str(exc.detail))
        return error_response(413, body, headers)
    if exc.status_code < 500:
        body = ErrorBody(code=ErrorCode.VALIDATION_ERROR, message=f"Invalid request: {exc.detail}")
        return error_response(422, body, headers, param="body")
    body = ErrorBody(code=ErrorCode.INTERNAL_ERROR, message=str(exc.detail))
    return error_response(exc.status_code, body, headers)


async def _internal_error(_: Request, exc: Exception) -> JSONResponse:
    body = ErrorBody(
        code=ErrorCode.INTERNAL_ERROR,
        message=f"The gateway failed on this request ({type(exc).__name__}); it was logged.",
    )
    return error_response(500, body)


def install_error_handlers(app: FastAPI) -> None:
    app.add_exception_handler(ApiError, _api_error)
    app.add_exception_handler(RequestValidationError, _validation_error)
    app.add_exception_handler(HTTPException, _http_error)
    # The last resort still answers in the envelope (and is still logged and reported).
    app.add_exception_handler(Exception, _internal_error)


_STATUS = {
    ErrorCode.VALIDATION_ERROR: 422,
    ErrorCode.ROUTE_NOT_FOUND: 404,
    ErrorCode.METHOD_NOT_ALLOWED: 405,
    ErrorCode.PROMPT_TOO_LONG: 422,
    ErrorCode.UNSUPPORTED_PARAMETER: 422,
    ErrorCode.WEBHOOK_URL_FORBIDDEN: 422,
    ErrorCode.BATCH_INVALID: 422,
    ErrorCode.BATCH_TOO_LARGE: 413,
    ErrorCode.BATCH_EXCEEDS_LIMITS: 422,
    ErrorCode.FILE_QUOTA_EXCEEDED: 429,
    ErrorCode.BATCH_NOT_FOUND: 404,
    ErrorCode.FILE_NOT_FOUND: 404,
    ErrorCode.UNAUTHORIZED: 401,
    ErrorCode.FORBIDDEN: 403,
    ErrorCode.ADAPTER_NOT_FOUND: 404,
    ErrorCode.JOB_NOT_FOUND: 404,
    ErrorCode.ADAPTER_RETIRED: 410,
    ErrorCode.JOB_FINISHED: 409,
    ErrorCode.IDEMPOTENCY_CONFLICT: 409,
    ErrorCode.PAYLOAD_TOO_LARGE: 413,
    ErrorCode.HEADERS_TOO_LARGE: 431,
    ErrorCode.MALFORMED_REQUEST: 400,
    ErrorCode.HEADER_TIMEOUT: 408,
    ErrorCode.BODY_TIMEOUT: 408,
    ErrorCode.UNSUPPORTED_MEDIA_TYPE: 415,
    ErrorCode.TIER_LIMIT_EXCEEDED: 429,
    ErrorCode.TENANT_CONCURRENCY_EXCEEDED: 429,
    ErrorCode.TENANT_RATE_EXCEEDED: 429,
    ErrorCode.SERVICE_UNAVAILABLE: 503,
    ErrorCode.TIMEOUT: 504,
    # A job that failed after admission, answered by the endpoints that wait for it.
    ErrorCode.DEADLINE_EXCEEDED: 504,
    ErrorCode.CANCELLED: 409,
    ErrorCode.ADAPTER_INTEGRITY: 500,
    ErrorCode.ADAPTER_UNAVAILABLE: 500,
    ErrorCode.ADAPTER_LOAD_FAILED: 500,
    ErrorCode.BASE_MODEL_MISMATCH: 500,
    ErrorCode.ENGINE_ERROR: 500,
    ErrorCode.ATTEMPTS_EXHAUSTED: 500,
    ErrorCode.INTERNAL_ERROR: 500,
}

AUTHENTICATED = (
    ErrorCode.UNAUTHORIZED,
    ErrorCode.VALIDATION_ERROR,
    ErrorCode.PAYLOAD_TOO_LARGE,
    ErrorCode.HEADERS_TOO_LARGE,
    ErrorCode.MALFORMED_REQUEST,
    ErrorCode.HEADER_TIMEOUT,
    ErrorCode.BODY_TIMEOUT,
    ErrorCode.SERVICE_UNAVAILABLE,
)
"""Codes any authenticated endpoint can answer."""

ADMISSION = (
    *AUTHENTICATED,
    ErrorCode.UNSUPPORTED_MEDIA_TYPE,
    ErrorCode.ADAPTER_NOT_FOUND,
    ErrorCode.ADAPTER_RETIRED,
    ErrorCode.ADAPTER_UNAVAILABLE,
    ErrorCode.PROMPT_TOO_LONG,
    ErrorCode.IDEMPOTENCY_CONFLICT,
    ErrorCode.TIER_LIMIT_EXCEEDED,
    ErrorCode.TENANT_CONCURRENCY_EXCEEDED,
    ErrorCode.TENANT_RATE_EXCEEDED,
)
"""Codes of every endpoint that admits a job."""


def status_of(code: ErrorCode) -> int:
    """The HTTP status ``code`` is answered with."""
    return _STATUS[code]


def responses(*codes: ErrorCode) -> dict[int | str, dict[str, Any]]:
    """OpenAPI ``responses`` documenting ``codes``, grouped by HTTP status; each status also
    lists its codes machine-readably under ``x-error-codes``."""
    by_status: dict[int, list[ErrorCode]] = {}
    for code in dict.fromkeys(codes):
        by_status.setdefault(_STATUS[code], []).append(code)
    return {
        status: {
            "model": ErrorEnvelope,
            "description": "Error codes: " + ", ".join(f"`{code.value}`" for code in grouped),
            "x-error-codes": [code.value for code in grouped],
        }
        for status, grouped in sorted(by_status.items())
    }
