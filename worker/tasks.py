"""The job task: read the message, claim the job, run it, store the outcome exactly once.

Delivery is at least once (the message is acknowledged only after this function returns, so a
worker that dies mid-job leaves it to be redelivered); effects are exactly once because every
record change is a compare-and-set (``contracts.job_records``): the first terminal write wins,
a later delivery of a finished job does nothing, and a delivery of a job another attempt is
running waits for that attempt's lease instead of running it twice.
"""

from __future__ import annotations

import logging
import time
from typing import Any, NoReturn

import sentry_sdk
from celery.exceptions import Reject
from pydantic import ValidationError
from redis.exceptions import RedisError

from contracts.errors import ErrorBody, ErrorCode
from contracts.jobs import JobMessage, JobPublic
from contracts.queues import RUN_JOB_TASK
from contracts.telemetry import error_scope
from worker import metrics
from worker.celery_app import app, runtime
from worker.errors import JobFailure, JobStopped, StopReason, StoreUnreachable
from worker.job_store import ClaimOutcome
from worker.receive import is_taken_over, taken_over
from worker.runtime import WorkerRuntime

log = logging.getLogger(__name__)


@app.task(name=RUN_JOB_TASK)
def run_job(payload: dict[str, Any]) -> None:
    """Run one job; its outcome is written to the job record, never returned to Celery."""
    rt = runtime()
    # From its receipt (``worker.held``) until the outcome is stored, if this worker dies,
    # another worker's reaper puts the message back on its queue.
    delivery = str((run_job.request.delivery_info or {}).get("delivery_tag", ""))
    # The job's error reports (and the log below) carry its tags and breadcrumbs, no other
    # job's; a hand-back is not an error.
    with error_scope(expected=(Reject,)):
        try:
            _run(rt, payload, delivery)
        except (RedisError, StoreUnreachable) as exc:
            # Redis stayed unreachable longer than the job store waits: the outcome could not
            # be stored. Back to the queue rather than acknowledged, so the job is not lost.
            # (Only Redis: any other error was stored as the job's failure, and the job is
            # done.)
            log.error("job record unreachable (%s); handing the job back", exc)
            raise Reject(f"job store unreachable: {exc}", requeue=True) from None
        finally:
            # The outcome is stored (or the job handed back): nothing for a reaper to restore.
            # Unless another attempt took the job over: a reaper took this delivery back
            # already, and if this worker received it again, its entry is that delivery's.
            if not is_taken_over(delivery):
                rt.held.finished(delivery)


def _hand_back(rt: WorkerRuntime, why: str) -> NoReturn:
    """Back to the queue for another worker, once this one takes no more jobs (or it might
    receive the same message again)."""
    rt.consumption_stopped(timeout_s=rt.settings.engine_failure_exit_s)
    raise Reject(why, requeue=True)


def _run(rt: WorkerRuntime, payload: dict[str, Any], delivery: str) -> None:
    began = time.thread_time()
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
    if rt.failed:
        _hand_back(rt, "this worker's engine failed")
    # Error reports name the job and the weights, never the prompt (contracts.telemetry).
    sentry_sdk.set_tags(
        {
            "job_id": message.job_id,
            "tenant": message.tenant,
            "adapter": message.adapter,
            "revision": message.revision,
        }
    )
    rt.check_deadline_span(message)
    claim = rt.jobs.claim(
        message.job_id,
        rt.settings.max_attempts,
        wait_until=message.deadline_at + rt.settings.sweep_grace_s,
        abandon=lambda: rt.failed,
        rejoin_s=rt.settings.lease_rejoin_s,
        delivery=delivery,
        routed_to=message.routed.worker if message.routed else None,
    )
    metrics.DELIVERIES.labels(claim.outcome.value).inc()
    if claim.outcome == ClaimOutcome.EXHAUSTED:
        metrics.job_finished(message, "failed", ErrorCode.ATTEMPTS_EXHAUSTED, None)
    if claim.outcome == ClaimOutcome.ABANDONED:
        _hand_back(rt, "this worker's engine failed while the job waited for its lease")
    if claim.outcome != ClaimOutcome.RUN or claim.job is None:
        log.info("job %s not run: %s", message.job_id, claim.outcome.value)
        return
    _attempt(rt, message, claim.job, began, delivery)


def _leave_if_taken_over(rt: WorkerRuntime, running: JobPublic, delivery: str) -> None:
    """This attempt ends without its outcome (refused, or its lease lost): if the job has not
    ended, another attempt took it over after this one's lease lapsed, and the broker's record
    of the delivery is that attempt's now: this worker's ack must leave it
    (``worker.receive.taken_over``)."""
    current = rt.jobs.get(running.id)
    if current is None or current.status.terminal:
        return
    log.warning(
        "job %s: attempt %d ends without an outcome; attempt %d (worker %s) holds the job",
        running.id,
        running.attempts,
        current.attempts,
        current.worker,
    )
    taken_over(delivery)


def _attempt(
    rt: WorkerRuntime, message: JobMessage, running: JobPublic, began: float, delivery: str
) -> None:
    """Run the attempt just claimed and store its outcome (or hand the job back)."""
    last_chance = 0 < running.engine_failures >= rt.settings.max_attempts - 1
    with rt.inflight.track(message.job_id, running.attempts, began) as handle:
        try:
            result, metadata = rt.runner.run(message, handle, last_chance)
        except JobStopped as stopped:
            if stopped.reason in (StopReason.CANCELLED, StopReason.LEASE_LOST):
                # Cancelled: the record says so. Lease lost: another attempt owns the job, and
                # the broker's record of this delivery with it.
                log.info("job %s stopped while running: %s", message.job_id, stopped.reason)
                if stopped.reason == StopReason.LEASE_LOST:
                    _leave_if_taken_over(rt, running, delivery)
                return
            if stopped.reason == StopReason.ENGINE_FAILED:
                given = rt.jobs.survive_engine(running, handle.in_engine, rt.settings.max_attempts)
                log.warning(
                    "job %s: engine failed (in the engine: %s, last chance: %s): %s",
                    message.job_id,
                    handle.in_engine,
                    last_chance,
                    "handed back" if given == ClaimOutcome.RUN else given or "already written",
                )
                if given == ClaimOutcome.EXHAUSTED:
                    metrics.job_finished(message, "failed", ErrorCode.ATTEMPTS_EXHAUSTED, None)
                if given is None:
                    _leave_if_taken_over(rt, running, delivery)
                if given != ClaimOutcome.RUN:
                    return  # ended here, or by another writer: nothing to hand back
                _hand_back(rt, "this worker's engine failed")
            if not rt.jobs.release(running):
                # Ended meanwhile (nothing to hand back), or another attempt holds it.
                log.warning("job %s not handed back at shutdown: written since", message.job_id)
                _leave_if_taken_over(rt, running, delivery)
                return
            log.warning("job %s handed back at shutdown", message.job_id)
            raise Reject("worker shutting down", requeue=True) from None
        except JobFailure as failure:
            log.warning("job %s failed: %s %s", message.job_id, failure.code, failure.message)
            body = ErrorBody(code=failure.code, message=failure.message)
            if rt.jobs.fail(running, body, failure.metadata):
                metrics.job_finished(message, "failed", failure.code, failure.metadata)
            else:
                _leave_if_taken_over(rt, running, delivery)
            return
        except (RedisError, StoreUnreachable):
            raise
        except Exception as exc:
            log.exception("job %s crashed", message.job_id)
            body = ErrorBody(
                code=ErrorCode.ENGINE_ERROR,
                message=f"The worker could not run the job: {type(exc).__name__}.",
            )
            if rt.jobs.fail(running, body, None):
                metrics.job_finished(message, "failed", ErrorCode.ENGINE_ERROR, None)
            else:
                _leave_if_taken_over(rt, running, delivery)
            sentry_sdk.capture_exception(exc)
            return
        # Still tracked (its lease renewed, a drain waiting for it) while S3 takes it.
        budget_s = message.deadline_at + rt.settings.sweep_grace_s - time.time()
        kept, metadata = rt.results.place(message.tenant, result, metadata, budget_s)
    if rt.jobs.succeed(running, kept, metadata):
        metrics.job_finished(message, "succeeded", None, metadata)
    else:
        _leave_if_taken_over(rt, running, delivery)
    if handle.cpu_resumed is not None:
        metrics.JOB_CPU.labels("finish").inc(time.thread_time() - handle.cpu_resumed)
