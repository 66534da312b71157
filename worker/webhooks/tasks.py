"""The delivery task: one attempt of one event, its conclusion written to the schedule."""

from __future__ import annotations

import logging
from functools import cache

import sentry_sdk

from contracts.queues import DELIVER_WEBHOOK_TASK
from contracts.telemetry import error_scope
from contracts.webhooks import DeliveryState
from worker.webhooks.app import app, redis, settings
from worker.webhooks.deliver import Deliverer
from worker.webhooks.schedule import Schedule

log = logging.getLogger(__name__)


@cache
def _deliverer() -> Deliverer:
    return Deliverer(redis, settings)


@app.task(name=DELIVER_WEBHOOK_TASK)
def deliver_webhook(event_id: str) -> None:
    # The delivery's error reports carry its tags and breadcrumbs, no other delivery's.
    with error_scope():
        sentry_sdk.set_tag("event_id", event_id)
        _deliver(event_id)


def _deliver(event_id: str) -> None:
    schedule = Schedule(redis)
    event = schedule.event(event_id)
    if event is None or event.state != DeliveryState.PENDING:
        return  # expired, or concluded by an earlier attempt
    sentry_sdk.set_tag("tenant", event.tenant)
    conclusion = _deliverer().attempt(event)
    schedule.conclude(event, event.attempts + 1, conclusion)
    log.info(
        "webhook %s attempt %d: %s (%s)",
        event_id,
        event.attempts + 1,
        conclusion.state.value,
        conclusion.status_code or conclusion.error,
    )
