"""The Celery app of the worker (``celery -A worker.celery_app worker``). Kept tiny.

All reliability settings live here, together, each with the reason it is set.
"""

from __future__ import annotations

import logging
from typing import Any

from celery import Celery
from celery.signals import worker_init, worker_ready, worker_shutdown

from contracts.queues import ALL_QUEUES
from contracts.telemetry import SENTRY_OPTIONS
from worker.config import get_settings
from worker.runtime import WorkerRuntime

log = logging.getLogger(__name__)
settings = get_settings()

app = Celery("lorafleet", broker=settings.effective_broker_url, include=["worker.tasks"])
app.conf.update(
    # Acknowledge only after the task returned (result stored): a crash mid-job redelivers it.
    task_acks_late=True,
    # Prefork pools: a task whose child process died goes back to the queue. (With the
    # threads pool a dead worker never acknowledged, so Redis redelivers after the timeout.)
    task_reject_on_worker_lost=True,
    # Unacked jobs return to the queue after this long; must exceed the longest job.
    broker_transport_options={"visibility_timeout": settings.visibility_timeout_s},
    # Reserve one job per pool thread, no more: a busy worker cannot hoard a queue.
    worker_prefetch_multiplier=1,
    # Results live in our own job records (contracts.keys.job_key), not Celery's backend.
    task_ignore_result=True,
    task_default_queue=ALL_QUEUES[0],
    broker_connection_retry_on_startup=True,
    worker_hijack_root_logger=False,
)

_runtime: WorkerRuntime | None = None


def runtime() -> WorkerRuntime:
    """The process's runtime; exists from ``worker_init`` until ``worker_shutdown``."""
    if _runtime is None:
        raise RuntimeError("the worker runtime is not started")
    return _runtime


@worker_init.connect
def _start_runtime(**_: Any) -> None:
    global _runtime
    if settings.sentry_dsn:
        import sentry_sdk

        sentry_sdk.init(dsn=settings.sentry_dsn, **SENTRY_OPTIONS)
    candidate = WorkerRuntime(settings)
    try:
        candidate.start()
    except Exception:
        # Celery logs and swallows exceptions from signal handlers; a worker without its
        # engine must not consume jobs, so leave for real.
        log.exception("worker runtime failed to start")
        candidate.close()
        raise SystemExit(1) from None
    _runtime = candidate


@worker_ready.connect
def _announce(**_: Any) -> None:
    # Only now does the consumer (and its remote-control mailbox) run: announce readiness here,
    # not when the engine is up, so "ready" means "taking jobs".
    runtime().announce()


@worker_shutdown.connect
def _stop_runtime(**_: Any) -> None:
    # vLLM's engine-core child processes keep the worker alive on SIGTERM unless the engine
    # is shut down explicitly.
    global _runtime
    if _runtime is not None:
        _runtime.close()
        _runtime = None
