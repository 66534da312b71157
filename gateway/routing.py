"""The gateway's view of the fleet, and the routing decision made from it at admission.

Routing needs the queues in the job store's Redis (the default: no ``LORAFLEET_BROKER_URL``
of its own), and no live worker of a release without own queues (during a rolling upgrade
every job goes to its shared queue).

Every ``LORAFLEET_ROUTE_REFRESH_S`` one task reads every live worker's announcement and the
length of its own queue (two pipelined round trips, whatever the traffic); admissions route
on that view in memory (``contracts.routing.choose``), so routing adds no Redis round trip
to an admission. Between two reads the gateway counts what it routed to each worker, so a
burst does not pile onto the worker that looked idlest at the last read, and it remembers
where it placed each adapter until the view shows the adapter there (``choose``'s
``placing``), so a view that lags a fetch never lets this gateway place a copy past the cap.
Each gateway knows only its own placements: two gateways placing the same adapter in the same
instant can make a copy more each (the rendezvous ranking keeps them on the same workers).

A route counts from the moment it is chosen (a batch's jobs spread as they are routed one by
one), and is taken back if its job is not admitted (``settle``): a refused job leaves no
placement, no count against its worker and no routing metric behind. A job whose admission's
fate is unknown (a lost reply, its caller gone: the admission is withdrawn in the background,
which can fail) keeps its placement until it lapses, so that a copy that may be made after all
still counts against the cap.
"""

from __future__ import annotations

import asyncio
import itertools
import json
import logging
import time
from collections import Counter
from dataclasses import dataclass
from typing import Any

from redis.asyncio import Redis
from redis.exceptions import RedisError

from contracts import routing
from contracts.jobs import JobMessage, Routed
from contracts.keys import WORKERS_INDEX, worker_key
from contracts.queues import Tier, queue_for
from gateway.background import LoopTask
from gateway.config import GatewaySettings
from gateway.metrics import GatewayMetrics

log = logging.getLogger(__name__)

PLACING_TTL_S = 30.0
"""How long a placement counts as a copy while the worker's announcement does not show it:
longer than an adapter's fetch takes. A placement whose job went back to the shared queue
before its fetch began stops counting after it."""


def predates_routing(record: dict[str, Any]) -> bool:
    """A serving worker of a release without own queues: it refuses a message that names a
    routing (its job schema forbids unknown fields), and a routed job handed back to a shared
    queue could reach it, so nothing is routed while one lives (a rolling upgrade)."""
    return record.get("state") == "serving" and "queue" not in record


def worker_state(
    record: dict[str, Any], waiting: int, now: float, max_age_s: float
) -> routing.WorkerState | None:
    """A serving worker's announcement as routing sees it; ``None`` for a worker routing must
    not send to: draining, failed, one that predates own queues, or one silent for longer
    than ``max_age_s`` (it publishes every second while it lives; a killed worker's record
    outlives it by its heartbeat expiry)."""
    queue = record.get("queue")
    worker_id = str(record.get("worker_id"))
    if record.get("state") != "serving" or queue != routing.worker_queue(worker_id):
        return None
    if now - float(record.get("seen_at") or 0) > max_age_s:
        return None
    held = record.get("adapters") or {}
    adapters = {
        digest: routing.LEVELS_BY_NAME[level]
        for digest, level in held.items()
        if level in routing.LEVELS_BY_NAME
    }
    return routing.WorkerState(
        worker_id=worker_id,
        base_model=str((record.get("base_model") or {}).get("digest", "")),
        queues=frozenset(record.get("queues") or ()),
        concurrency=int(record.get("concurrency") or 1),
        outstanding=int(record.get("jobs_running") or 0) + waiting,
        adapters=adapters,
        slots=int(record.get("max_loras") or 1),
    )


async def announcements(redis: Redis) -> list[tuple[dict[str, Any], int]]:
    """Every live worker's announcement, with the jobs waiting in its own queue (two round
    trips: the index, then the records and lengths pipelined); expired ones left out."""
    ids = sorted(str(member) for member in await redis.smembers(WORKERS_INDEX))
    if not ids:
        return []
    async with redis.pipeline(transaction=False) as pipe:
        pipe.mget([worker_key(worker_id) for worker_id in ids])
        for worker_id in ids:
            pipe.llen(routing.worker_queue(worker_id))
        replies = await pipe.execute()
    return [
        (json.loads(raw), int(waiting))
        for raw, waiting in zip(replies[0], replies[1:], strict=True)
        if raw is not None  # its announcement expired: gone
    ]


PENDING_TTL_S = 600.0
"""A route not settled after this long is dropped from memory (every route is settled when its
admission ends; this only bounds what a missed one could hold)."""


@dataclass(frozen=True)
class _Route:
    """A route chosen and not settled yet."""

    worker: str
    digest: str
    view: int  # the fleet view it was counted in
    placement: int | None  # the placement it made or joined, if placed
    at: float  # monotonic


class FleetRouter(LoopTask):
    def __init__(self, redis: Redis, settings: GatewaySettings, metrics: GatewayMetrics) -> None:
        super().__init__("fleet-router")
        self._redis = redis
        self._settings = settings
        self._metrics = metrics
        self._policy = routing.Policy(settings.route_max_copies, settings.route_overload_ratio)
        self._workers: list[routing.WorkerState] = []
        self._read_at = -float("inf")  # monotonic
        self._routed: Counter[str] = Counter()
        self._view = 0  # counts the reads of the fleet: ``_routed`` is per view
        # Adapter digest -> worker id -> (when this gateway placed it there (monotonic), the
        # placement's number), until the worker's announcement shows it or ``PLACING_TTL_S``
        # passes.
        self._placing: dict[str, dict[str, tuple[float, int]]] = {}
        self._placements = itertools.count(1)
        # Placement number -> its jobs not taken back: one whose every job was refused is
        # dropped at once.
        self._placed_jobs: Counter[int] = Counter()
        self._pending: dict[str, _Route] = {}  # job id -> its route, until settled
        # Routed messages are pushed by the admission script onto lists of the job store's
        # Redis, where the queue keepers hand them back: a broker of its own is not routed to.
        self._enabled = settings.routing and settings.effective_broker_url == settings.redis_url
        if settings.routing and not self._enabled:
            log.warning("routing is off: the queues live on a broker of their own")

    async def run(self) -> None:
        while True:
            try:
                await self.refresh()
            except (RedisError, OSError, TimeoutError, ValueError) as exc:
                log.warning("could not read the fleet for routing: %s", exc)
            await asyncio.sleep(self._settings.route_refresh_s)

    async def refresh(self) -> None:
        """Read every announced worker and its queue's length (two round trips)."""
        workers: list[routing.WorkerState] = []
        now = time.time()
        for record, waiting in await announcements(self._redis):
            if predates_routing(record):
                workers = []
                break
            state = worker_state(record, waiting, now, self._settings.route_view_max_age_s)
            if state is not None:
                workers.append(state)
        self._workers, self._read_at, self._routed = workers, time.monotonic(), Counter()
        self._view += 1
        self._forget_placements(workers)
        lapsed = self._read_at - PENDING_TTL_S
        for job_id in [job_id for job_id, r in self._pending.items() if r.at < lapsed]:
            del self._pending[job_id]
        self._metrics.fleet_copies(routing.copies(workers))

    def _forget_placements(self, workers: list[routing.WorkerState]) -> None:
        """Drop the placements the view now shows as held, and those older than
        ``PLACING_TTL_S`` (a job handed back before its fetch began, a worker gone). A worker
        missing from one view (a late announcement) keeps its placements: its fetch goes on."""
        held = {worker.worker_id: worker.adapters for worker in workers}
        oldest = time.monotonic() - PLACING_TTL_S
        for digest, placed in list(self._placing.items()):
            for worker_id, (at, number) in list(placed.items()):
                if at < oldest or digest in held.get(worker_id, {}):
                    del placed[worker_id]
                    self._placed_jobs.pop(number, None)
            if not placed:
                del self._placing[digest]

    def route(self, job_id: str, base_model: str, tier: Tier, digest: str) -> Routed | None:
        """The routing of job ``job_id``, about to be admitted; ``None``: its pool queue
        (``destination`` names the queue either way). Counted at once; ``settle`` it once its
        admission is decided."""
        decision = routing.SHARED
        fresh = time.monotonic() - self._read_at <= self._settings.route_view_max_age_s
        if self._enabled and fresh:
            decision = routing.choose(
                self._workers,
                base_model,
                queue_for(tier, base_model),
                digest,
                self._policy,
                self._routed,
                self._placing.get(digest, {}),
            )
        if decision.worker is None:
            return None
        worker, now = decision.worker.worker_id, time.monotonic()
        self._routed[worker] += 1
        number = None
        if decision.decision == routing.Decision.PLACED:
            # From the first placement on: later jobs sent after it do not extend its life.
            placed = self._placing.setdefault(digest, {})
            number = placed.setdefault(worker, (now, next(self._placements)))[1]
            self._placed_jobs[number] += 1
        self._pending[job_id] = _Route(worker, digest, self._view, number, now)
        return Routed.model_validate({"decision": decision.decision.value, "worker": worker})

    def settle(
        self, job_id: str, tier: Tier, routed: Routed | None, admitted: bool, refused: bool
    ) -> None:
        """Job ``job_id``'s admission is decided: admitted (counted in the metrics), or not, its
        route taken back (the count against its worker, if no read of the fleet reset it
        since). A job ``refused`` (nothing was written) also gives its placement back, which
        ends once no other job holds it; one whose admission's fate is unknown keeps it until
        it lapses. Settling a job again does nothing."""
        pending = self._pending.pop(job_id, None)
        if admitted:
            decision = routing.Decision.SHARED.value if routed is None else routed.decision
            self._metrics.routing.labels(tier.value, decision).inc()
            return
        if pending is None:
            return
        if pending.view == self._view and self._routed[pending.worker] > 0:
            self._routed[pending.worker] -= 1
        if pending.placement is None or not refused:
            return
        self._placed_jobs[pending.placement] -= 1
        if self._placed_jobs[pending.placement] > 0:
            return
        del self._placed_jobs[pending.placement]
        placed = self._placing.get(pending.digest, {})
        if placed.get(pending.worker, (0.0, None))[1] == pending.placement:
            del placed[pending.worker]
            if not placed:
                del self._placing[pending.digest]


def destination(message: JobMessage) -> str:
    """The queue a job's message is pushed onto: its worker's own, or its pool queue."""
    if message.routed is not None:
        return routing.worker_queue(message.routed.worker)
    return queue_for(message.tier, message.base_model.digest)
