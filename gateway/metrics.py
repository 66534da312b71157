"""The gateway's Prometheus metrics (``GET /metrics``): what it admits and refuses, and, read
from Redis at each scrape, each pool queue's depth (a tier of one base model's pool),
admitted-unfinished jobs and the age of its oldest waiting job. Each app has its own
registry (several apps may share a process)."""

from __future__ import annotations

import threading
import time

from prometheus_client import CollectorRegistry, Counter, Gauge, generate_latest
from redis.asyncio import Redis

from contracts import metrics as names
from contracts.queues import Tier
from gateway.pool_state import queue_states

REGISTRY_RECORDS_INVALID = Counter(
    names.REGISTRY_RECORDS_INVALID,
    "Registry records skipped (listing) or refused (admission) because they do not parse.",
    registry=None,
)
"""Counted by the registry readers, which have no app at hand: one counter per process,
shown by every app in it."""


COPIES_LABELS = 8
"""``lorafleet_adapters_by_copies`` has a label per copy count up to this one ('8+')."""


class GatewayMetrics:
    def __init__(self, top_adapters: int) -> None:
        self.registry = CollectorRegistry()
        r = self.registry
        r.register(REGISTRY_RECORDS_INVALID)
        self.admitted = Counter(names.JOBS_ADMITTED, "Jobs admitted.", ["tier"], registry=r)
        self.heap_frozen = Gauge(
            names.HEAP_FROZEN,
            "Objects of this process's start-up heap frozen out of garbage collection "
            "(contracts.warm_process).",
            registry=r,
        )
        self.refused = Counter(
            names.ADMISSIONS_REFUSED, "Submissions refused, by error code.", ["code"], registry=r
        )
        self.finished = Counter(
            names.JOBS_FINISHED,
            "Jobs cancelled by their caller (the workers count every other outcome).",
            ["tier", "status", "code"],
            registry=r,
        )
        self.adapter_requests = Counter(
            names.ADAPTER_REQUESTS,
            f"Jobs admitted per adapter: the first {top_adapters} aliases by name, then "
            f"'{names.OTHER}'.",
            ["adapter"],
            registry=r,
        )
        self.access_recalls = Counter(
            names.ACCESS_RECALLS,
            "Admissions whose access was recalled, not read, by what the admission found: "
            "held (unchanged), changed (read again).",
            ["outcome"],
            registry=r,
        )
        self.routing = Counter(
            names.ROUTING_DECISIONS,
            "Jobs routed at admission, by tier and decision (resident, placed: to a copy being "
            "made, shared).",
            ["tier", "decision"],
            registry=r,
        )
        self.copies = Gauge(
            names.ADAPTER_COPIES,
            "Adapters held by this many live workers (any level), as the gateway last read the "
            f"fleet; copies 1..{COPIES_LABELS - 1}, then '{COPIES_LABELS}+'.",
            ["copies"],
            registry=r,
        )
        # Per pool queue: a tier of one base model's pool (``pool``: its id, ``base_model``:
        # the model's name); as many label sets as tiers x base models.
        queue_labels = ["tier", "pool", "base_model"]
        self.queue_depth = Gauge(names.QUEUE_DEPTH, "Jobs waiting.", queue_labels, registry=r)
        self.unfinished = Gauge(
            names.ADMITTED_UNFINISHED, "Jobs admitted, not finished.", queue_labels, registry=r
        )
        self.oldest_age = Gauge(
            names.QUEUE_OLDEST_AGE,
            "Age of the oldest waiting job, seconds.",
            queue_labels,
            registry=r,
        )
        self._top_adapters = top_adapters
        self._named: set[str] = set()
        self._lock = threading.Lock()

    def admitted_job(self, tier: Tier, alias: str) -> None:
        self.admitted.labels(tier.value).inc()
        with self._lock:
            # A label for each of the first K aliases, kept for good (counters stay monotonic);
            # every later alias counts as "other": cardinality never exceeds K + 1.
            if alias not in self._named and len(self._named) < self._top_adapters:
                self._named.add(alias)
            label = alias if alias in self._named else names.OTHER
        self.adapter_requests.labels(label).inc()

    def fleet_copies(self, per_adapter: dict[str, int]) -> None:
        """Set the copies gauge from ``adapter -> copies`` (bounded labels, not adapters)."""
        counts = [0] * (COPIES_LABELS + 1)
        for held in per_adapter.values():
            counts[min(held, COPIES_LABELS)] += 1
        for held in range(1, COPIES_LABELS + 1):
            label = str(held) if held < COPIES_LABELS else f"{COPIES_LABELS}+"
            self.copies.labels(label).set(counts[held])

    def job_cancelled(self, tier: Tier) -> None:
        self.finished.labels(tier.value, "cancelled", "cancelled").inc()

    async def render(self, redis: Redis) -> bytes:
        states = await queue_states(redis, time.time())
        # Only the pool queues Redis knows now (no label set outlives its pool's entry).
        for gauge in (self.queue_depth, self.unfinished, self.oldest_age):
            gauge.clear()
        for state in states:
            labels = (state.tier.value, state.pool, state.base_model.id)
            self.queue_depth.labels(*labels).set(state.queue_depth)
            self.unfinished.labels(*labels).set(state.admitted_unfinished)
            self.oldest_age.labels(*labels).set(state.oldest_waiting_s)
        return generate_latest(self.registry)
