"""``/v1/batches``: many jobs at once (lorafleet's shape or OpenAI's Batch API)."""

from __future__ import annotations

import hashlib
import json
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import Annotated, Any

from fastapi import APIRouter, Query, Request, Response
from fastapi.concurrency import run_in_threadpool
from fastapi.responses import StreamingResponse
from pydantic import ValidationError
from pydantic.json_schema import models_json_schema
from redis.exceptions import RedisError
from starlette.requests import ClientDisconnect

from contracts.batches import BatchPublic
from contracts.errors import ErrorCode
from contracts.strict_json import JsonRefusal
from contracts.webhooks import MAX_URL_CHARS, WebhookTarget
from gateway.auth import CallerDep, TenantDep
from gateway.batches import (
    BatchCreate,
    LineError,
    OpenAIBatchCreate,
    Parsed,
    jsonl,
    parse_native,
    parse_openai,
)
from gateway.deps import BatchesDep, FilesDep
from gateway.errors import (
    ADMISSION,
    AUTHENTICATED,
    ApiError,
    invalid,
    responses,
    shown,
    unavailable,
)
from gateway.idempotency import fingerprint
from gateway.json_bodies import JSONL_TYPES, loads_off_loop
from gateway.routes.jobs import IdempotencyKeyHeader
from gateway.submit import Idempotency

router = APIRouter(prefix="/v1/batches", tags=["batches"])

_NDJSON: dict[int | str, dict[str, Any]] = {200: {"content": {"application/x-ndjson": {}}}}
_REPLAY: dict[int | str, dict[str, Any]] = {
    200: {"model": BatchPublic, "description": "Idempotent replay: the earlier batch"}
}
_NOT_READ = "The batch could not be read: {what} ({exc}); retry."

_BODY = {
    "requestBody": {
        "required": True,
        "content": {
            "application/json": {
                "schema": {
                    "oneOf": [
                        {"$ref": "#/components/schemas/BatchCreate"},
                        {"$ref": "#/components/schemas/OpenAIBatchCreate"},
                    ]
                }
            },
            "application/jsonl": {"schema": {"type": "string", "description": "one job a line"}},
        },
    }
}


def body_schemas() -> dict[str, Any]:
    """The components ``_BODY`` refers to, for the app's OpenAPI document.

    FastAPI never sees these models (the route reads its JSON or JSONL body itself), so it
    would not put them in ``components``.
    """
    _, document = models_json_schema(
        [(BatchCreate, "validation"), (OpenAIBatchCreate, "validation")],
        ref_template="#/components/schemas/{model}",
    )
    return dict(document["$defs"])


def _not_found(batch_id: str) -> ApiError:
    return ApiError(404, ErrorCode.BATCH_NOT_FOUND, f"No batch with id {shown(batch_id)} exists.")


@router.post(
    "",
    status_code=202,
    response_model=BatchPublic,
    openapi_extra=_BODY,
    responses=_REPLAY
    | responses(
        *ADMISSION,
        ErrorCode.WEBHOOK_URL_FORBIDDEN,
        ErrorCode.BATCH_INVALID,
        ErrorCode.BATCH_TOO_LARGE,
        ErrorCode.BATCH_EXCEEDS_LIMITS,
        ErrorCode.FILE_NOT_FOUND,
    ),
)
async def create_batch(
    request: Request,
    response: Response,
    tenant: TenantDep,
    caller: CallerDep,
    batches: BatchesDep,
    files: FilesDep,
    webhook_url: Annotated[
        str | None,
        Query(
            min_length=1,
            max_length=MAX_URL_CHARS,
            description="JSONL bodies: the batch's webhook URL",
        ),
    ] = None,
    deadline_s: Annotated[
        float | None, Query(gt=0, allow_inf_nan=False, description="JSONL bodies")
    ] = None,
    idempotency_key: IdempotencyKeyHeader = None,
) -> BatchPublic:
    """Validate every request, then enqueue all of them (or none): a JSON body
    ``{"requests": [...], "webhook"?, "deadline_s"?}``, a JSONL body (one job a line), or
    OpenAI's ``{"input_file_id", "endpoint"}`` naming an uploaded file.

    With an ``Idempotency-Key`` seen before (the same body, byte for byte, and query): 200
    and the earlier batch, nothing enqueued again."""
    content_type = request.headers.get("content-type", "").split(";")[0].strip().lower()
    try:
        body = await request.body()
    except ClientDisconnect:
        # The client left, or ``BodyLimit`` cut the body off and has answered (408, 413):
        # nobody reads this answer. (FastAPI answers its own routes' bodies so.)
        raise ApiError(
            400, ErrorCode.VALIDATION_ERROR, "The request body did not arrive whole."
        ) from None
    idempotency = None
    if idempotency_key is not None:
        asked = {
            "content_type": content_type,
            "body": hashlib.sha256(body).hexdigest(),
            "webhook_url": webhook_url,
            "deadline_s": deadline_s,
        }
        idempotency = Idempotency(idempotency_key, fingerprint("/v1/batches", asked))
    if content_type in JSONL_TYPES:
        # Parsing a large body takes long enough to stall every other request: off the loop.
        items = await run_in_threadpool(jsonl, body)
        lines = [_parsed(item, parse_native) for item in items]
        webhook = WebhookTarget(url=webhook_url) if webhook_url else None
        batch, replayed = await batches.create(
            tenant, caller, lines, "/v1/jobs", webhook, deadline_s, idempotency=idempotency
        )
    else:
        try:
            payload: Any = await loads_off_loop(body)
        except JsonRefusal as exc:
            raise ApiError(
                422, ErrorCode.VALIDATION_ERROR, f"Invalid request: body: {exc}", param="body"
            ) from exc
        if isinstance(payload, dict) and "input_file_id" in payload:
            try:
                spec = OpenAIBatchCreate.model_validate(payload)
            except ValidationError as exc:
                raise invalid(exc) from exc
            content = await files.content_of_upload(tenant, spec.input_file_id)
            items = await run_in_threadpool(jsonl, content)
            endpoint = spec.endpoint
            lines = [
                _parsed(item, lambda value, n: parse_openai(value, n, endpoint)) for item in items
            ]
            batch, replayed = await batches.create(
                tenant,
                caller,
                lines,
                spec.endpoint,
                metadata=spec.metadata,
                input_file_id=spec.input_file_id,
                idempotency=idempotency,
            )
        else:
            try:
                create = BatchCreate.model_validate(payload)
            except ValidationError as exc:
                raise invalid(exc) from exc
            lines = [parse_native(item, n) for n, item in enumerate(create.requests, 1)]
            batch, replayed = await batches.create(
                tenant,
                caller,
                lines,
                "/v1/jobs",
                create.webhook,
                create.deadline_s,
                create.metadata,
                idempotency=idempotency,
            )
    if replayed:
        response.status_code = 200
    response.headers["Location"] = f"/v1/batches/{batch.id}"
    return batch


def _parsed(
    item: tuple[int, Any] | LineError, parse: Callable[[Any, int], Parsed | LineError]
) -> Parsed | LineError:
    return item if isinstance(item, LineError) else parse(item[1], item[0])


@router.get(
    "/{batch_id}",
    response_model=BatchPublic,
    responses=responses(*AUTHENTICATED, ErrorCode.BATCH_NOT_FOUND),
)
async def get_batch(batch_id: str, tenant: TenantDep, batches: BatchesDep) -> BatchPublic:
    """Counts by status, progress, and (once finished) the webhook's delivery."""
    return await _existing(batches.get(tenant, batch_id), batch_id)


@router.get(
    "/{batch_id}/results",
    response_class=StreamingResponse,
    responses=_NDJSON
    | responses(*AUTHENTICATED, ErrorCode.BATCH_NOT_FOUND, ErrorCode.INTERNAL_ERROR),
)
async def batch_results(batch_id: str, tenant: TenantDep, batches: BatchesDep) -> StreamingResponse:
    """JSONL, in submission order: ``custom_id``, ``job_id``, ``status``, ``result``,
    ``error``, ``metadata`` of each request (``status`` queued or running until it ends)."""
    await _existing(batches.get(tenant, batch_id), batch_id)
    chunks = batches.lines(batch_id, with_results=True)
    # The first chunk (500 lines) is read before answering: a result that cannot be read
    # there is an error status, not a cut body (later chunks can only cut it).
    first = await anext(chunks, None)

    async def lines() -> AsyncIterator[bytes]:
        chunk = first
        while chunk is not None:
            out = []
            for line, job in chunk:
                entry = {
                    "custom_id": line.custom_id,
                    "job_id": line.job_id,
                    "status": job.status.value if job else "expired",
                    "result": job.result.model_dump(mode="json") if job and job.result else None,
                    "error": job.error.model_dump(mode="json") if job and job.error else None,
                    "metadata": (
                        job.metadata.model_dump(mode="json") if job and job.metadata else None
                    ),
                }
                out.append(json.dumps(entry, separators=(",", ":")) + "\n")
            yield "".join(out).encode()
            chunk = await anext(chunks, None)

    return StreamingResponse(lines(), media_type="application/x-ndjson")


async def _existing(read: Awaitable[BatchPublic | None], batch_id: str) -> BatchPublic:
    """The batch ``read`` answers, 404 if there is none (for this tenant), 503 on Redis."""
    try:
        batch = await read
    except (RedisError, OSError) as exc:
        raise unavailable("the batch store is unreachable", exc, _NOT_READ) from exc
    if batch is None:
        raise _not_found(batch_id)
    return batch


_CANCEL_ERRORS = responses(*AUTHENTICATED, ErrorCode.BATCH_NOT_FOUND)


@router.delete("/{batch_id}", response_model=BatchPublic, responses=_CANCEL_ERRORS)
async def cancel_batch(batch_id: str, tenant: TenantDep, batches: BatchesDep) -> BatchPublic:
    """Cancel every job of the batch that has not started; running jobs finish."""
    return await _existing(batches.cancel(tenant, batch_id), batch_id)


@router.post("/{batch_id}/cancel", response_model=BatchPublic, responses=_CANCEL_ERRORS)
async def cancel_batch_openai(batch_id: str, tenant: TenantDep, batches: BatchesDep) -> BatchPublic:
    """OpenAI's spelling of ``DELETE /v1/batches/{id}``."""
    return await _existing(batches.cancel(tenant, batch_id), batch_id)
