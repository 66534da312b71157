"""OpenAI's Files API, for batches: uploaded batch inputs, and each finished batch's output
and error files (made from its jobs' records when they are read)."""

from __future__ import annotations

import json
import time
import uuid
from typing import Any, Literal

from pydantic import BaseModel
from redis.asyncio import Redis

from contracts.batches import BatchLine, error_file_id, output_file_id
from contracts.errors import ErrorCode
from contracts.jobs import JobPublic, JobStatus
from contracts.keys import file_key
from contracts.tenants import TenantRecord
from gateway.batches import Batches
from gateway.errors import ApiError
from gateway.openai_schemas import chat_completion_of, completion_of

FILE_TTL_S = 7 * 24 * 3600


class FileObject(BaseModel):
    id: str
    object: Literal["file"] = "file"
    bytes: int
    created_at: int
    filename: str
    purpose: str
    status: Literal["processed"] = "processed"


def _not_found(file_id: str) -> ApiError:
    return ApiError(404, ErrorCode.FILE_NOT_FOUND, f"No file with id {file_id!r} exists.")


def _output_line(line: BatchLine, job: JobPublic | None) -> tuple[bool, dict[str, Any]] | None:
    """``(is_error, line)`` of OpenAI's batch output format; ``None`` while still pending."""
    if job is None:
        error = {"code": "expired", "message": "The job's record has expired."}
        return True, {
            "id": f"batch_req_{line.job_id}",
            "custom_id": line.custom_id,
            "response": None,
            "error": error,
        }
    if not job.status.terminal:
        return None
    if job.status != JobStatus.SUCCEEDED or job.result is None:
        failure = job.error.model_dump(mode="json") if job.error else None
        return True, {
            "id": f"batch_req_{job.id}",
            "custom_id": line.custom_id,
            "response": None,
            "error": failure,
        }
    created = int(job.finished_at.timestamp()) if job.finished_at else int(time.time())
    body: Any
    if line.endpoint == "/v1/completions":
        body = completion_of(job, line.model, created).model_dump(mode="json")
    elif line.endpoint == "/v1/chat/completions":
        body = chat_completion_of(job, line.model, created).model_dump(mode="json")
    else:
        body = job.model_dump(mode="json")
    response = {"status_code": 200, "request_id": job.id, "body": body}
    return False, {
        "id": f"batch_req_{job.id}",
        "custom_id": line.custom_id,
        "response": response,
        "error": None,
    }


class Files:
    def __init__(self, redis: Redis, batches: Batches) -> None:
        self._redis = redis
        self._batches = batches

    async def upload(
        self, tenant: TenantRecord, filename: str, purpose: str, content: bytes
    ) -> FileObject:
        if purpose != "batch":
            raise ApiError(
                422,
                ErrorCode.VALIDATION_ERROR,
                f"Invalid request: purpose: only 'batch' files are accepted, not {purpose!r}.",
                param="purpose",
            )
        meta = FileObject(
            id="file-" + uuid.uuid4().hex,
            bytes=len(content),
            created_at=int(time.time()),
            filename=filename,
            purpose=purpose,
        )
        key = file_key(meta.id)
        async with self._redis.pipeline(transaction=True) as pipe:
            pipe.hset(
                key,
                mapping={
                    "meta": meta.model_dump_json(),
                    "tenant": tenant.name,
                    "content": content.decode("utf-8", errors="replace"),
                },
            )
            pipe.expire(key, FILE_TTL_S)
            await pipe.execute()
        return meta

    async def content_of_upload(self, tenant: TenantRecord, file_id: str) -> bytes:
        async with self._redis.pipeline(transaction=False) as pipe:
            pipe.hget(file_key(file_id), "tenant")
            pipe.hget(file_key(file_id), "content")
            owner, content = await pipe.execute()
        if owner != tenant.name or content is None:
            raise _not_found(file_id)
        return str(content).encode()

    async def meta(self, tenant: TenantRecord, file_id: str) -> FileObject:
        produced = await self._produced(tenant, file_id)
        if produced is not None:
            return FileObject(
                id=file_id,
                bytes=len(produced),
                created_at=int(time.time()),
                filename=f"{file_id}.jsonl",
                purpose="batch_output",
            )
        async with self._redis.pipeline(transaction=False) as pipe:
            pipe.hget(file_key(file_id), "tenant")
            pipe.hget(file_key(file_id), "meta")
            owner, meta = await pipe.execute()
        if owner != tenant.name or meta is None:
            raise _not_found(file_id)
        return FileObject.model_validate_json(meta)

    async def content(self, tenant: TenantRecord, file_id: str) -> bytes:
        produced = await self._produced(tenant, file_id)
        if produced is not None:
            return produced
        return await self.content_of_upload(tenant, file_id)

    async def _produced(self, tenant: TenantRecord, file_id: str) -> bytes | None:
        """A finished batch's output or error file, if ``file_id`` names one."""
        for suffix, errors in (("-output", False), ("-errors", True)):
            if file_id.startswith("file-batch-") and file_id.endswith(suffix):
                batch_id = file_id.removeprefix("file-batch-").removesuffix(suffix)
                batch = await self._batches.get(tenant, batch_id)
                expected = error_file_id(batch_id) if errors else output_file_id(batch_id)
                if batch is None or batch.output_file_id is None or expected != file_id:
                    raise _not_found(file_id)
                out = []
                async for chunk in self._batches.lines(batch_id):
                    for line, job in chunk:
                        made = _output_line(line, job)
                        if made is not None and made[0] == errors:
                            out.append(json.dumps(made[1], separators=(",", ":")) + "\n")
                return "".join(out).encode()
        return None
