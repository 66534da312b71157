"""The job task: validate the payload, advance the record, hand off to ``JobRunner``."""

from __future__ import annotations

import logging
from typing import Any

from pydantic import ValidationError

from contracts.errors import ErrorBody, ErrorCode
from contracts.jobs import JobMessage
from contracts.queues import RUN_JOB_TASK
from worker.celery_app import app, runtime
from worker.errors import JobFailure

log = logging.getLogger(__name__)


@app.task(name=RUN_JOB_TASK)
def run_job(payload: dict[str, Any]) -> None:
    """Run one job; its outcome is written to the job record, never returned to Celery."""
    rt = runtime()
    try:
        message = JobMessage.model_validate(payload)
    except ValidationError as exc:
        # A producer of another version: fail the job visibly rather than leave it queued.
        log.exception("malformed job message")
        job_id = payload.get("job_id") if isinstance(payload, dict) else None
        job = rt.jobs.get(job_id) if isinstance(job_id, str) else None
        if job is not None:
            body = ErrorBody(
                code=ErrorCode.INTERNAL_ERROR,
                message=f"The job message could not be read by this worker: {exc.error_count()} "
                "problem(s).",
            )
            rt.jobs.fail(job, body, None)
        return
    job = rt.jobs.get(message.job_id)
    if job is None:
        log.warning("job %s has no record (expired or withdrawn); skipping", message.job_id)
        return
    running = rt.jobs.mark_running(job)
    if running is None:
        log.info("job %s already finished; skipping the duplicate delivery", message.job_id)
        return
    try:
        result, metadata = rt.runner.run(message)
    except JobFailure as failure:
        log.warning("job %s failed: %s %s", message.job_id, failure.code, failure.message)
        rt.jobs.fail(
            running, ErrorBody(code=failure.code, message=failure.message), failure.metadata
        )
        return
    except Exception as exc:
        log.exception("job %s crashed", message.job_id)
        body = ErrorBody(
            code=ErrorCode.ENGINE_ERROR,
            message=f"The worker could not run the job: {type(exc).__name__}.",
        )
        rt.jobs.fail(running, body, None)
        raise
    rt.jobs.succeed(running, result, metadata)
