"""Redis key layout shared by every process (one place, so a rename breaks loudly)."""

from __future__ import annotations

PREFIX = "lorafleet"


def adapter_key(alias: str) -> str:
    """JSON ``AdapterRecord`` of one alias."""
    return f"{PREFIX}:adapter:{alias}"


ADAPTERS_INDEX = f"{PREFIX}:adapters"
"""Set of every registered alias."""

RETIRED_INDEX = f"{PREFIX}:adapters:retired"
"""Set of retired aliases: still resolvable for queued jobs, refused for new ones."""


def channel_key(name: str) -> str:
    """String: the alias a channel points to now."""
    return f"{PREFIX}:channel:{name}"


CHANNELS_INDEX = f"{PREFIX}:channels"
"""Set of every channel name."""


def job_key(job_id: str) -> str:
    """Hash: one job's public record (``record``, JSON), ``status`` and ``attempts``."""
    return f"{PREFIX}:job:{job_id}"


JOB_EVENTS = f"{PREFIX}:job-events"
"""Pub/sub channel: a job id is published each time a job reaches a terminal state."""

JOB_CANCELS = f"{PREFIX}:job-cancels"
"""Pub/sub channel: a job id is published when a caller cancels it (workers abort it)."""


def worker_key(hostname: str) -> str:
    """JSON heartbeat a worker writes once its engine is ready, refreshed while it lives."""
    return f"{PREFIX}:worker:{hostname}"


def held_key(worker_id: str) -> str:
    """Hash ``task id -> broker delivery tag`` of the jobs a worker has received and not yet
    finished; a dead worker's entries are handed back to their queues (``worker.reaper``)."""
    return f"{PREFIX}:held:{worker_id}"


WORKERS_INDEX = f"{PREFIX}:workers"
"""Set of worker hostnames that have announced themselves."""
