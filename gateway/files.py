"""OpenAI's Files API, for batches: uploaded batch inputs, and each finished batch's output
and error files (made from its jobs' records when they are read)."""

from __future__ import annotations

import json
import logging
import time
import uuid
from typing import Any, Literal

from fastapi.concurrency import run_in_threadpool
from pydantic import BaseModel
from redis.asyncio import Redis
from redis.exceptions import RedisError

from contracts.batches import BatchLine, BatchPublic, error_file_id, output_file_id
from contracts.errors import ErrorCode
from contracts.jobs import JobPublic, JobStatus
from contracts.keys import batch_key, file_key, tenant_file_bytes_key, tenant_files_key
from contracts.storage import stored_result
from contracts.tenants import TenantRecord
from gateway.batches import Batches, openai_file_errors, refused
from gateway.config import GatewaySettings
from gateway.errors import ApiError, shown
from gateway.openai_schemas import chat_completion_of, completion_of

log = logging.getLogger(__name__)


class FileObject(BaseModel):
    id: str
    object: Literal["file"] = "file"
    bytes: int
    created_at: int
    filename: str
    purpose: str
    status: Literal["processed"] = "processed"


def _not_found(file_id: str) -> ApiError:
    return ApiError(404, ErrorCode.FILE_NOT_FOUND, f"No file with id {shown(file_id)} exists.")


def _output_line(
    line: BatchLine, job: JobPublic | None, errors: bool
) -> tuple[bool, dict[str, Any]] | None:
    """``(is_error, line)`` of OpenAI's batch output format; ``None`` while still pending, and
    for a success when only ``errors`` are wanted (its result, perhaps in the object store,
    is not read then)."""
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
    if job.status == JobStatus.SUCCEEDED and (job.result or stored_result(job)) and errors:
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


# Quota and write in one script, so concurrent uploads can't overshoot the caps. Expired
# files leave the tenant's index first (their hashes expired with them). The shebang makes
# a full Redis (noeviction) refuse the whole script up front: nothing is stored past maxmemory.
_STORE = """#!lua
local args = cjson.decode(ARGV[1])
local index, sizes, file = KEYS[1], KEYS[2], KEYS[3]
for _, id in ipairs(redis.call('ZRANGEBYSCORE', index, '-inf', args.now)) do
  redis.call('HDEL', sizes, id)
end
redis.call('ZREMRANGEBYSCORE', index, '-inf', args.now)
local count = redis.call('ZCARD', index)
local used = 0
for _, size in ipairs(redis.call('HVALS', sizes)) do used = used + tonumber(size) end
if count + 1 > args.max_count then return {'count', count, used} end
if used + args.size > args.max_bytes then return {'bytes', count, used} end
redis.call('HSET', file, 'meta', ARGV[2], 'tenant', args.tenant, 'content', ARGV[3])
redis.call('EXPIRE', file, args.ttl_s)
redis.call('ZADD', index, args.expires_at, args.file_id)
redis.call('HSET', sizes, args.file_id, args.size)
redis.call('EXPIRE', index, args.ttl_s)
redis.call('EXPIRE', sizes, args.ttl_s)
return {'ok', count + 1, used + args.size}
"""

_DELETE = """
if redis.call('HGET', KEYS[3], 'tenant') ~= ARGV[1] then return 0 end
redis.call('DEL', KEYS[3])
redis.call('ZREM', KEYS[1], ARGV[2])
redis.call('HDEL', KEYS[2], ARGV[2])
return 1
"""


def _keys(tenant: TenantRecord, file_id: str) -> list[str]:
    """The keys both scripts take: the tenant's file index and sizes, and the file."""
    return [tenant_files_key(tenant.name), tenant_file_bytes_key(tenant.name), file_key(file_id)]


class Files:
    def __init__(self, redis: Redis, batches: Batches, settings: GatewaySettings) -> None:
        self._redis = redis
        self._batches = batches
        self._settings = settings

    async def upload(
        self, tenant: TenantRecord, filename: str, purpose: str, content: bytes
    ) -> FileObject:
        """Store a batch input file, if it is one (JSONL of valid request lines) and fits
        the tenant's quota; stored as sent, returned byte for byte."""
        if purpose != "batch":
            raise ApiError(
                422,
                ErrorCode.VALIDATION_ERROR,
                f"Invalid request: purpose: only 'batch' files are accepted, not {shown(purpose)}.",
                param="purpose",
            )
        errors, total = await run_in_threadpool(openai_file_errors, content)
        if errors:
            raise refused(errors, total, what="file lines", then="nothing was stored")
        if total == 0:
            raise ApiError(422, ErrorCode.BATCH_INVALID, "The file holds no requests.")
        now = int(time.time())
        meta = FileObject(
            id="file-" + uuid.uuid4().hex,
            bytes=len(content),
            created_at=now,
            filename=filename,
            purpose=purpose,
        )
        settings = self._settings
        args = {
            "now": now,
            "expires_at": now + settings.file_ttl_s,
            "file_id": meta.id,
            "size": len(content),
            "max_count": settings.max_files_per_tenant,
            "max_bytes": settings.max_file_bytes_per_tenant,
            "ttl_s": settings.file_ttl_s,
            "tenant": tenant.name,
        }
        keys = _keys(tenant, meta.id)
        # Valid UTF-8 (checked above), so the text is the bytes, byte for byte.
        stored = [json.dumps(args), meta.model_dump_json(), content.decode("utf-8")]
        verdict, count, used = await self._redis.register_script(_STORE)(keys=keys, args=stored)
        if verdict != "ok":
            limit = (
                f"{settings.max_files_per_tenant} files"
                if verdict == "count"
                else f"{settings.max_file_bytes_per_tenant} bytes of files"
            )
            raise ApiError(
                429,
                ErrorCode.FILE_QUOTA_EXCEEDED,
                f"Tenant {tenant.name!r} may store {limit} (it holds {count} files, "
                f"{used} bytes); this one of {len(content)} bytes was not stored. Delete "
                f"files (DELETE /v1/files/{{id}}) or wait for them to expire.",
            )
        return meta

    async def delete(self, tenant: TenantRecord, file_id: str) -> None:
        """Delete an uploaded file, freeing its share of the tenant's quota."""
        keys = _keys(tenant, file_id)
        deleted = await self._redis.register_script(_DELETE)(keys=keys, args=[tenant.name, file_id])
        if not deleted:
            raise _not_found(file_id)

    async def content_of_upload(self, tenant: TenantRecord, file_id: str) -> bytes:
        async with self._redis.pipeline(transaction=False) as pipe:
            pipe.hget(file_key(file_id), "tenant")
            pipe.hget(file_key(file_id), "content")
            owner, content = await pipe.execute()
        if owner != tenant.name or content is None:
            raise _not_found(file_id)
        return str(content).encode()

    async def meta(self, tenant: TenantRecord, file_id: str) -> FileObject:
        batch = await self._batch_of(tenant, file_id)
        if batch is not None:
            ended = batch.completed_at or batch.cancelled_at or batch.created_at
            return FileObject(
                id=file_id,
                bytes=await self._produced_size(batch.id, file_id),
                created_at=ended,  # the file is whole from the batch's end on
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
        batch = await self._batch_of(tenant, file_id)
        if batch is not None:
            return await self._render(batch.id, file_id)
        return await self.content_of_upload(tenant, file_id)

    async def _produced_size(self, batch_id: str, file_id: str) -> int:
        """The size of a finished batch's output or error file: worked out once, when it is
        first asked for, and kept (it never changes, see ``_remember_size``), so that asking
        again reads no stored result."""
        known = await self._redis.hget(batch_key(batch_id), _size_field(file_id))
        if known is not None:
            return int(known)
        size = len(await self._render(batch_id, file_id))
        await self._remember_size(batch_id, file_id, size)
        return size

    async def _batch_of(self, tenant: TenantRecord, file_id: str) -> BatchPublic | None:
        """The finished batch of ``tenant`` whose output or error file ``file_id`` names;
        ``None`` if it names no such file (a 404 if it names one that is not there)."""
        for suffix, errors in (("-output", False), ("-errors", True)):
            if file_id.startswith("file-batch-") and file_id.endswith(suffix):
                batch_id = file_id.removeprefix("file-batch-").removesuffix(suffix)
                batch = await self._batches.get(tenant, batch_id)
                expected = error_file_id(batch_id) if errors else output_file_id(batch_id)
                if batch is None or batch.output_file_id is None or expected != file_id:
                    raise _not_found(file_id)
                return batch
        return None

    async def _render(self, batch_id: str, file_id: str) -> bytes:
        errors = file_id.endswith("-errors")
        out = []
        async for chunk in self._batches.lines(batch_id, with_results=not errors):
            for line, job in chunk:
                made = _output_line(line, job, errors)
                if made is not None and made[0] == errors:
                    out.append(json.dumps(made[1], separators=(",", ":")) + "\n")
        return "".join(out).encode()

    async def _remember_size(self, batch_id: str, file_id: str, size: int) -> None:
        """Keep a finished batch's file size in its hash, which expires with it. The file
        does not change while the batch is there: every job has ended, an ended job's
        record is never written again, and the records outlive the batch's hash (they get
        its TTL in the same script, and again on each later write). Best effort: a Redis
        that refuses the write (full) costs the next ask another reading of the file."""
        try:
            await self._redis.register_script(_REMEMBER)(
                keys=[batch_key(batch_id)], args=[_size_field(file_id), size]
            )
        except RedisError as exc:
            log.info("size of %s not kept: %s", file_id, exc)


_REMEMBER = """#!lua
if redis.call('HEXISTS', KEYS[1], 'record') == 1 then
  redis.call('HSET', KEYS[1], ARGV[1], ARGV[2])
end
"""
"""Only into a batch's hash that is there (no key without a TTL, no write to a tombstone)."""


def _size_field(file_id: str) -> str:
    return "bytes:" + file_id.rsplit("-", 1)[1]
