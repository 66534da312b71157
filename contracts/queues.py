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
POOL_ID_CHARS = 12


def pool_id(base_digest: str) -> str:
    """The pool of the workers serving the base model of ``base_digest`` (``sha256:<hex>``):
    the first ``POOL_ID_CHARS`` hex digits of its digest. Queue names, ledgers and metrics
    say which pool they belong to by this id."""
    return base_digest.rpartition(":")[2][:POOL_ID_CHARS]


def queue_for(tier: Tier, base_digest: str) -> str:
    """The Celery queue (a Redis list of the same name) of ``tier``'s jobs for the base model
    of ``base_digest``: ``lorafleet.<tier>.<pool id>``. Only workers serving that base model
    take from it, so a job never reaches a worker of another base model."""
    return f"{QUEUE_PREFIX}{tier.value}.{pool_id(base_digest)}"


def pool_queues(base_digest: str, tiers: tuple[Tier, ...] = tuple(Tier)) -> list[str]:
    """The shared queues a worker of ``base_digest`` taking ``tiers`` consumes."""
    return [queue_for(tier, base_digest) for tier in tiers]


UNROUTABLE_QUEUE = f"{QUEUE_PREFIX}unroutable"
"""Where a message handed back from a worker's own queue goes when its envelope names no pool
queue (not a job message of lorafleet's): kept for an operator to read, consumed by nobody."""

WEBHOOKS_QUEUE = f"{QUEUE_PREFIX}webhooks"
"""Callback deliveries: consumed by CPU-only webhook workers, never by GPU workers."""
DELIVER_WEBHOOK_TASK = "lorafleet.deliver_webhook"
