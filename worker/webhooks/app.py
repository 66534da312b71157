"""The Celery app of the webhook worker (``celery -A worker.webhooks.app worker``).

CPU only: it imports no engine. A dispatcher thread moves due deliveries from the schedule
(``worker.webhooks.schedule``) onto the ``lorafleet.webhooks`` queue; pool threads run one
attempt each. Messages are acknowledged on receipt: the schedule, not the broker, keeps an
event alive (an attempt lost with its worker becomes due again when its lease ends), and no
retry ever waits in a Celery countdown. It also stands for election as the deadline sweeper
(``worker.sweeper``), so jobs past their deadline end even while no GPU worker runs.
"""

from __future__ import annotations

import logging
import os
import socket
import threading
import uuid
from typing import Any

from celery import Celery
from celery.signals import worker_ready, worker_shutdown
from redis.exceptions import RedisError

from contracts.queues import DELIVER_WEBHOOK_TASK, WEBHOOKS_QUEUE
from contracts.redis_policy import sync_client
from contracts.telemetry import sentry_options
from worker.background import Background
from worker.job_store import JobStore
from worker.sweeper import DeadlineSweeper
from worker.webhooks.config import get_settings
from worker.webhooks.schedule import Schedule

log = logging.getLogger(__name__)
settings = get_settings()

app = Celery(
    "lorafleet-webhooks",
    broker=settings.effective_broker_url,
    include=["worker.webhooks.tasks"],
)
app.conf.update(
    task_acks_late=False,
    task_ignore_result=True,
    task_default_queue=WEBHOOKS_QUEUE,
    worker_prefetch_multiplier=1,
    broker_connection_retry_on_startup=True,
    worker_hijack_root_logger=False,
    # Deaf to broadcast control commands: an `add_consumer lorafleet.hot.<pool>` meant for the GPU
    # workers must never make this worker take (and drop, as unregistered) engine jobs.
    worker_enable_remote_control=False,
)

if settings.sentry_dsn:
    import sentry_sdk

    sentry_sdk.init(dsn=settings.sentry_dsn, **sentry_options())

redis = sync_client(
    settings.redis_url, settings.redis_max_connections, decode_responses=True, socket_timeout=10
)
_background: list[Background] = []


def _dispatch(stopping: threading.Event) -> None:
    schedule = Schedule(redis)
    while not stopping.is_set():
        try:
            for event_id in schedule.claim_due(settings.lease_s):
                app.send_task(DELIVER_WEBHOOK_TASK, args=[event_id], queue=WEBHOOKS_QUEUE)
        except (RedisError, OSError) as exc:
            log.warning("webhook dispatch failed (%s); retrying", exc)
        stopping.wait(settings.webhook_poll_s)


@worker_ready.connect
def _start_dispatcher(**_: Any) -> None:
    owner = f"webhooks:{socket.gethostname()}:{os.getpid()}:{uuid.uuid4().hex[:8]}"
    sweeper = DeadlineSweeper(
        redis,
        JobStore(redis, settings.job_ttl_s),
        owner,
        settings.sweep_interval_s,
        settings.sweep_grace_s,
    )
    _background[:] = [Background("webhook-dispatcher", _dispatch, join_timeout_s=10), sweeper]
    for thread in _background:
        thread.start()


@worker_shutdown.connect
def _stop_dispatcher(**_: Any) -> None:
    for thread in _background:
        thread.close()
