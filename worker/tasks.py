"""The job task: read the message, claim the job, run it, store the outcome exactly once.

Delivery is at least once (the message is acknowledged only after this function returns, so a
worker that dies mid-job leaves it to be redelivered); effects are exactly once because every
record change is a compare-and-set (``contracts.job_records``): the first terminal write wins and
a later delivery of a finished job does nothing.
"""

from __future__ import annotations

import logging
from typing import Any

import sentry_sdk
from celery.exceptions import Reject
from pydantic import ValidationError
from redis.exceptions import RedisError

from contracts.errors import ErrorBody, ErrorCode
from contracts.jobs import JobMessage
from contracts.queues import RUN_JOB_TASK
from worker import metrics
from worker.celery_app import app, runtime
from worker.errors import JobFailure, JobStopped, StopReason
from worker.job_store import ClaimOutcome

log = logging.getLogger(__name__)


@app.task(name=RUN_JOB_TASK)
def run_job(payload: dict[str, Any]) -> None:
    """Run one job; its outcome is written to the job record, never returned to Celery."""
    # From its receipt (``worker.held``) until the outcome is stored, if this worker dies,
    # another worker's reaper puts the message back on its queue.
    try:
        _run(payload)
    except (RedisError, OSError) as exc:
        # Redis stayed unreachable longer than the job store waits: the outcome could not be
        # stored. Back to the queue rather than acknowledged, so the job is not lost.
        log.error("job record unreachable (%s); handing the job back", exc)
        raise Reject(f"job store unreachable: {exc}", requeue=True) from None
    finally:
        # The outcome is stored (or the job handed back): nothing for a reaper to restore.
        runtime().held.finished(run_job.request.id)


def _run(payload: dict[str, Any]) -> None:
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
    # Error reports name the job and the weights, never the prompt (contracts.telemetry).
    sentry_sdk.set_tags(
        {
            "job_id": message.job_id,
            "tenant": message.tenant,
            "adapter": message.adapter,
            "revision": message.revision,
        }
    )
    claim = rt.jobs.claim(message.job_id, rt.worker_id, rt.settings.max_attempts)
    if claim.outcome == ClaimOutcome.EXHAUSTED:
        metrics.job_finished(message, "failed", ErrorCode.ATTEMPTS_EXHAUSTED, None)
    if claim.outcome != ClaimOutcome.RUN or claim.job is None:
        log.info("job %s not run: %s", message.job_id, claim.outcome.value)
        return
    running = claim.job
    with rt.inflight.track(message.job_id) as handle:
        try:
            result, metadata = rt.runner.run(message, handle, running.attempts)
        except JobStopped as stopped:
            if stopped.reason == StopReason.CANCELLED:
                log.info("job %s cancelled while running", message.job_id)
                return
            # Draining past the timeout: the job goes back to the queue for another worker.
            released = rt.jobs.release(running)
            log.warning("job %s handed back at shutdown (released=%s)", message.job_id, released)
            raise Reject("worker shutting down", requeue=True) from None
        except JobFailure as failure:
            log.warning("job %s failed: %s %s", message.job_id, failure.code, failure.message)
            body = ErrorBody(code=failure.code, message=failure.message)
            if rt.jobs.fail(running, body, failure.metadata):
                metrics.job_finished(message, "failed", failure.code, failure.metadata)
            return
        except Exception as exc:
            log.exception("job %s crashed", message.job_id)
            body = ErrorBody(
                code=ErrorCode.ENGINE_ERROR,
                message=f"The worker could not run the job: {type(exc).__name__}.",
            )
            if rt.jobs.fail(running, body, None):
                metrics.job_finished(message, "failed", ErrorCode.ENGINE_ERROR, None)
            raise
    if rt.jobs.succeed(running, result, metadata):
        metrics.job_finished(message, "succeeded", None, metadata)
