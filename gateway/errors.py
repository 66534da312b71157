"""Typed API errors: each carries an HTTP status, a stable code and a human sentence."""

from __future__ import annotations

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse

from contracts.errors import ErrorBody, ErrorCode


class ApiError(Exception):
    """An error answered to the caller as ``{"error": {"code", "message"}}``."""

    def __init__(
        self, status_code: int, code: ErrorCode, message: str, headers: dict[str, str] | None = None
    ) -> None:
        super().__init__(message)
        self.status_code = status_code
        self.code = code
        self.message = message
        self.headers = headers


def _body(error: ErrorBody) -> dict[str, object]:
    return {"error": error.model_dump(mode="json", exclude_none=True)}


async def _api_error(_: Request, exc: Exception) -> JSONResponse:
    assert isinstance(exc, ApiError)
    body = ErrorBody(code=exc.code, message=exc.message)
    return JSONResponse(_body(body), status_code=exc.status_code, headers=exc.headers)


async def _validation_error(_: Request, exc: Exception) -> JSONResponse:
    assert isinstance(exc, RequestValidationError)
    details: list[dict[str, object]] = []
    for item in exc.errors():
        location = ".".join(str(part) for part in item.get("loc", ()) if part != "body")
        details.append({"field": location or "body", "message": item.get("msg", "invalid")})
    first = details[0] if details else {"field": "body", "message": "invalid request"}
    message = f"Invalid request: {first['field']}: {first['message']}"
    if len(details) > 1:
        message += f" (and {len(details) - 1} more problem(s))"
    body = ErrorBody(code=ErrorCode.VALIDATION_ERROR, message=message, details=details)
    return JSONResponse(_body(body), status_code=422)


def install_error_handlers(app: FastAPI) -> None:
    app.add_exception_handler(ApiError, _api_error)
    app.add_exception_handler(RequestValidationError, _validation_error)
