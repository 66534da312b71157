"""Queue and task names: the producer enqueues by name and never imports the consumer."""

from __future__ import annotations

from enum import StrEnum


class Tier(StrEnum):
    """Residency class of an adapter; each tier has its own queue and its own worker pool."""

    HOT = "hot"
    WARM = "warm"
    COLD = "cold"


QUEUE_PREFIX = "lorafleet."
RUN_JOB_TASK = "lorafleet.run_job"


def queue_for(tier: Tier) -> str:
    """The Celery queue (a Redis list of the same name) that carries jobs of ``tier``."""
    return f"{QUEUE_PREFIX}{tier.value}"


ALL_QUEUES: tuple[str, ...] = tuple(queue_for(tier) for tier in Tier)

WEBHOOKS_QUEUE = f"{QUEUE_PREFIX}webhooks"
"""Callback deliveries: consumed by CPU-only webhook workers, never by GPU workers."""
DELIVER_WEBHOOK_TASK = "lorafleet.deliver_webhook"
