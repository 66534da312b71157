"""``/v1/jobs``: admit a job onto its tier queue, and report its status and result."""

from __future__ import annotations

import contextlib
import time
import uuid
from datetime import UTC, datetime
from typing import Annotated

from fastapi import APIRouter, Query, Response
from fastapi.concurrency import run_in_threadpool
from redis.exceptions import RedisError

from contracts.errors import ErrorCode
from contracts.jobs import JobAccepted, JobCreate, JobMessage, JobPublic, JobStatus
from contracts.queues import queue_for
from gateway import job_store
from gateway.deps import ProducerDep, RedisDep, SettingsDep, WaiterDep
from gateway.errors import ApiError
from gateway.queue import enqueue
from gateway.registry import resolve

router = APIRouter(prefix="/v1/jobs", tags=["jobs"])

_RETRY_AFTER = {"Retry-After": "2"}


_NOT_ADMITTED = "The job was not accepted: {what} ({exc}). Nothing was enqueued; retry."
_NOT_READ = "The job could not be read: {what} ({exc}); retry."
_NOT_CANCELLED = "The job was not cancelled: {what} ({exc}); retry."


def _unavailable(what: str, exc: Exception, template: str = _NOT_ADMITTED) -> ApiError:
    message = template.format(what=what, exc=type(exc).__name__)
    return ApiError(503, ErrorCode.SERVICE_UNAVAILABLE, message, headers=_RETRY_AFTER)


@router.post("", status_code=202, response_model=JobAccepted)
async def create_job(
    body: JobCreate,
    response: Response,
    redis: RedisDep,
    producer: ProducerDep,
    settings: SettingsDep,
) -> JobAccepted:
    """Resolve the adapter alias to its revision, record the job, enqueue it on its tier."""
    try:
        resolved = await resolve(redis, body.adapter)
    except (RedisError, OSError) as exc:
        raise _unavailable("the registry is unreachable", exc) from exc
    if resolved is None:
        raise ApiError(
            404,
            ErrorCode.ADAPTER_NOT_FOUND,
            f"No adapter named {body.adapter!r} is available. Nothing was enqueued.",
        )
    if resolved.retired:
        raise ApiError(
            410,
            ErrorCode.ADAPTER_RETIRED,
            f"Adapter {resolved.record.alias!r} is retired and takes no new jobs. "
            "Nothing was enqueued.",
        )
    record = resolved.record

    if body.deadline_s is not None and body.deadline_s > settings.job_deadline_s:
        raise ApiError(
            422,
            ErrorCode.VALIDATION_ERROR,
            f"Invalid request: deadline_s: at most {settings.job_deadline_s:g} seconds.",
        )
    accepted_at = time.time()
    deadline_at = accepted_at + (body.deadline_s or settings.job_deadline_s)
    job_id = uuid.uuid4().hex
    queue = queue_for(record.tier)
    job = JobPublic(
        id=job_id,
        status=JobStatus.QUEUED,
        adapter=record.alias,
        channel=resolved.channel,
        revision=record.digest,
        queue=queue,
        created_at=datetime.fromtimestamp(accepted_at, tz=UTC),
        deadline_at=datetime.fromtimestamp(deadline_at, tz=UTC),
    )
    message = JobMessage(
        job_id=job_id,
        adapter=record.alias,
        revision=record.digest,
        base_model=record.base_model,
        tier=record.tier,
        prompt=body.prompt,
        sampling=body.sampling,
        accepted_at=accepted_at,
        deadline_at=deadline_at,
    )
    # The record exists before the message, so a fast worker always finds it; if the
    # publish fails the record is removed and the caller never sees a 202.
    try:
        await job_store.create_job(redis, job, settings.job_ttl_s)
    except (RedisError, OSError) as exc:
        raise _unavailable("the job store is unreachable", exc) from exc
    try:
        await run_in_threadpool(enqueue, producer, message)
    except Exception as exc:
        # If even the delete fails, the record expires with its TTL; no caller ever saw it.
        with contextlib.suppress(RedisError, OSError):
            await job_store.delete_job(redis, job_id)
        raise _unavailable("the queue is unreachable", exc) from exc

    response.headers["Location"] = f"/v1/jobs/{job_id}"
    return JobAccepted.model_validate(job.model_dump(include=set(JobAccepted.model_fields)))


MAX_WAIT_S = 60.0


@router.get("/{job_id}", response_model=JobPublic, response_model_exclude_none=False)
async def get_job(
    job_id: str,
    redis: RedisDep,
    waiter: WaiterDep,
    wait_s: Annotated[
        float,
        Query(ge=0, le=MAX_WAIT_S, description="Long-poll: wait up to this long for a result."),
    ] = 0.0,
) -> JobPublic:
    """The job's status and, once finished, its result or error and the run metadata.

    With ``wait_s``, answers as soon as the job finishes or when ``wait_s`` has passed.
    """
    deadline = time.monotonic() + wait_s
    async with waiter.watching(job_id) as finished:
        while True:
            try:
                job = await job_store.get_job(redis, job_id)
            except (RedisError, OSError) as exc:
                raise _unavailable("the job store is unreachable", exc, _NOT_READ) from exc
            if job is None:
                raise ApiError(404, ErrorCode.JOB_NOT_FOUND, f"No job with id {job_id!r} exists.")
            remaining = deadline - time.monotonic()
            if job.status.terminal or remaining <= 0:
                return job
            await waiter.sleep(finished, remaining)


@router.delete("/{job_id}", response_model=JobPublic)
async def cancel_job(job_id: str, redis: RedisDep, settings: SettingsDep) -> JobPublic:
    """Cancel a job: a queued job never runs; a running one is aborted in the engine.

    Answers the job as ``cancelled`` (also when it was already cancelled). A job that already
    succeeded or failed is left as it is: 409 ``job_finished``.
    """
    try:
        job = await job_store.cancel_job(redis, job_id, settings.job_ttl_s)
    except (RedisError, OSError) as exc:
        raise _unavailable("the job store is unreachable", exc, _NOT_CANCELLED) from exc
    if job is None:
        raise ApiError(404, ErrorCode.JOB_NOT_FOUND, f"No job with id {job_id!r} exists.")
    if job.status != JobStatus.CANCELLED:
        raise ApiError(
            409,
            ErrorCode.JOB_FINISHED,
            f"Job {job_id!r} already {job.status.value}; there is nothing to cancel.",
        )
    return job
