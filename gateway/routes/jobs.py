"""``/v1/jobs``: admit a job onto its pool queue, and report its status and result."""

from __future__ import annotations

from typing import Annotated, Any

from fastapi import APIRouter, Header, Query, Response
from redis.exceptions import RedisError

from contracts.errors import ErrorCode
from contracts.jobs import JobAccepted, JobCreate, JobPublic, JobStatus
from contracts.webhooks import job_event_id
from gateway import job_store
from gateway.auth import JobAccessDep, TenantDep
from gateway.deps import (
    MetricsDep,
    RedisDep,
    ResultsDep,
    SettingsDep,
    SubmitterDep,
    WaiterDep,
)
from gateway.errors import ADMISSION, AUTHENTICATED, ApiError, responses, shown, unavailable
from gateway.idempotency import fingerprint
from gateway.submit import Idempotency, Submission
from gateway.webhooks import delivery_status

router = APIRouter(prefix="/v1/jobs", tags=["jobs"])

_REPLAY: dict[int | str, dict[str, Any]] = {
    200: {"model": JobAccepted, "description": "Idempotent replay: the earlier job"}
}

_NOT_READ = "The job could not be read: {what} ({exc}); retry."
_NOT_CANCELLED = "The job was not cancelled: {what} ({exc}); retry."

IdempotencyKeyHeader = Annotated[
    str | None,
    Header(
        alias="Idempotency-Key",
        min_length=1,
        max_length=255,
        description="Same key and body within 24 h: the same job (200), enqueued once.",
    ),
]


def _not_found(job_id: str) -> ApiError:
    # The same answer whether the job never existed or belongs to another tenant.
    return ApiError(404, ErrorCode.JOB_NOT_FOUND, f"No job with id {shown(job_id)} exists.")


@router.post(
    "",
    status_code=202,
    response_model=JobAccepted,
    responses=_REPLAY | responses(*ADMISSION, ErrorCode.WEBHOOK_URL_FORBIDDEN),
)
async def create_job(
    body: JobCreate,
    response: Response,
    access: JobAccessDep,
    submitter: SubmitterDep,
    idempotency_key: IdempotencyKeyHeader = None,
) -> JobAccepted:
    """Resolve the adapter to its revision, admit the job, enqueue it on its pool queue.

    With an ``Idempotency-Key`` seen before (same body): 200 and the earlier job.
    """
    idempotency = None
    if idempotency_key is not None:
        idempotency = Idempotency(
            idempotency_key, fingerprint("/v1/jobs", body.model_dump(mode="json"))
        )
    request = Submission(
        adapter=body.adapter,
        prompt=body.prompt,
        sampling=body.sampling,
        deadline_s=body.deadline_s,
        webhook=body.webhook,
    )
    admitted = await submitter.submit(access, request, idempotency)
    if admitted.replayed:
        response.status_code = 200
    job = admitted.job
    response.headers["Location"] = f"/v1/jobs/{job.id}"
    return JobAccepted.model_validate(job.model_dump(include=set(JobAccepted.model_fields)))


MAX_WAIT_S = 60.0


@router.get(
    "/{job_id}",
    response_model=JobPublic,
    response_model_exclude_none=False,
    # internal_error: a result kept in the object store is gone or damaged.
    responses=responses(*AUTHENTICATED, ErrorCode.JOB_NOT_FOUND, ErrorCode.INTERNAL_ERROR),
)
async def get_job(
    job_id: str,
    tenant: TenantDep,
    redis: RedisDep,
    waiter: WaiterDep,
    results: ResultsDep,
    wait_s: Annotated[
        float,
        Query(
            ge=0,
            le=MAX_WAIT_S,
            allow_inf_nan=False,
            description="Long-poll: wait up to this long for a result.",
        ),
    ] = 0.0,
) -> JobPublic:
    """The job's status and, once finished, its result or error and the run metadata.

    With ``wait_s``, answers as soon as the job finishes or when ``wait_s`` has passed.
    """
    try:
        job = await waiter.wait(redis, job_id, tenant.name, wait_s)
    except (RedisError, OSError) as exc:
        raise unavailable("the job store is unreachable", exc, _NOT_READ) from exc
    if job is None:
        raise _not_found(job_id)
    if job.webhook is not None and job.status.terminal:
        try:
            delivery = await delivery_status(redis, job_event_id(job.id))
        except (RedisError, OSError) as exc:
            raise unavailable("the job store is unreachable", exc, _NOT_READ) from exc
        job = job.model_copy(update={"webhook_delivery": delivery})
    return await results.read(job)


@router.delete(
    "/{job_id}",
    response_model=JobPublic,
    responses=responses(*AUTHENTICATED, ErrorCode.JOB_NOT_FOUND, ErrorCode.JOB_FINISHED),
)
async def cancel_job(
    job_id: str, tenant: TenantDep, redis: RedisDep, settings: SettingsDep, metrics: MetricsDep
) -> JobPublic:
    """Cancel a job: a queued job never runs; a running one is aborted in the engine.

    Answers the job as ``cancelled`` (also when it was already cancelled). A job that already
    succeeded or failed is left as it is: 409 ``job_finished``.
    """
    try:
        job, cancelled = await job_store.cancel_job(redis, job_id, tenant.name, settings.job_ttl_s)
    except (RedisError, OSError) as exc:
        raise unavailable("the job store is unreachable", exc, _NOT_CANCELLED) from exc
    if job is None:
        raise _not_found(job_id)
    if job.status != JobStatus.CANCELLED:
        raise ApiError(
            409,
            ErrorCode.JOB_FINISHED,
            f"Job {job_id!r} already {job.status.value}; there is nothing to cancel.",
        )
    if cancelled:
        metrics.job_cancelled(job.tier)
    return job
