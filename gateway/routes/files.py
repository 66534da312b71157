"""``/v1/files``: OpenAI's Files API for batch input and output files."""

from __future__ import annotations

from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from typing import Annotated, Any

from fastapi import APIRouter, File, Form, UploadFile
from fastapi.responses import Response
from redis.exceptions import RedisError

from contracts.errors import ErrorCode
from gateway.auth import TenantDep
from gateway.deps import FilesDep
from gateway.errors import AUTHENTICATED, responses, unavailable
from gateway.files import FileObject

router = APIRouter(prefix="/v1/files", tags=["batches"])

_JSONL: dict[int | str, dict[str, Any]] = {200: {"content": {"application/jsonl": {}}}}
_ERRORS = responses(*AUTHENTICATED, ErrorCode.FILE_NOT_FOUND)


@asynccontextmanager
async def _store() -> AsyncIterator[None]:
    """Redis failing (unreachable, or full and refusing writes) is a retryable 503."""
    try:
        yield
    except (RedisError, OSError) as exc:
        raise unavailable(
            "the file store is unreachable or full", exc, "{what} ({exc}); retry."
        ) from exc


@router.post(
    "",
    response_model=FileObject,
    responses=responses(*AUTHENTICATED, ErrorCode.BATCH_INVALID, ErrorCode.FILE_QUOTA_EXCEEDED),
)
async def upload_file(
    tenant: TenantDep,
    files: FilesDep,
    file: Annotated[UploadFile, File(description="JSONL: one batch request a line")],
    purpose: Annotated[str, Form(description="must be 'batch'")],
) -> FileObject:
    """Store a batch input file (``purpose=batch``: JSONL, every line a valid request to
    ``/v1/completions`` or ``/v1/chat/completions``) for ``POST /v1/batches``."""
    content = await file.read()
    async with _store():
        return await files.upload(tenant, file.filename or "upload.jsonl", purpose, content)


@router.get(
    "/{file_id}",
    response_model=FileObject,
    responses=responses(*AUTHENTICATED, ErrorCode.FILE_NOT_FOUND, ErrorCode.INTERNAL_ERROR),
)
async def get_file(file_id: str, tenant: TenantDep, files: FilesDep) -> FileObject:
    """A file's object. A batch's output file is made once to learn its size (its results
    kept in the object store read back: the errors ``content`` can answer); its size is
    then remembered while the batch is kept."""
    async with _store():
        return await files.meta(tenant, file_id)


@router.get(
    "/{file_id}/content",
    response_class=Response,
    responses=_JSONL
    | responses(*AUTHENTICATED, ErrorCode.FILE_NOT_FOUND, ErrorCode.INTERNAL_ERROR),
)
async def file_content(file_id: str, tenant: TenantDep, files: FilesDep) -> Response:
    """The file's bytes: an upload, or a finished batch's output / error JSONL."""
    async with _store():
        content = await files.content(tenant, file_id)
    return Response(content, media_type="application/jsonl")


@router.delete("/{file_id}", responses=_ERRORS)
async def delete_file(file_id: str, tenant: TenantDep, files: FilesDep) -> dict[str, object]:
    """Delete an uploaded file, freeing its share of the tenant's quota."""
    async with _store():
        await files.delete(tenant, file_id)
    return {"id": file_id, "object": "file", "deleted": True}
