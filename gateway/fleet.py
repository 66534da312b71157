"""Fleet state for operators and autoscalers (``GET /v1/fleet``), read from Redis: per pool
queue (one tier of one base model's pool), its admitted jobs, the workers consuming it, and
how many workers it should have.

Recommended replicas per pool queue::

    by_load = ceil(admitted_unfinished / LORAFLEET_FLEET_TARGET_JOBS_PER_WORKER)
    by_age  = workers + 1   if the oldest waiting job is older than
                              LORAFLEET_FLEET_MAX_QUEUE_AGE_S, else 0
    recommended = max(MIN_REPLICAS[tier], by_load, by_age)

A hot tier never goes below one worker; warm and cold scale to zero when idle (the KEDA
objects in ``infra/k8s`` scale on the same ledger, exported as
``lorafleet_admitted_unfinished{tier, pool, base_model}``).
"""

from __future__ import annotations

import math
import time
from collections import Counter

from pydantic import BaseModel, Field
from redis.asyncio import Redis

from contracts.queues import Tier
from contracts.registry import BaseModelRef
from gateway.config import GatewaySettings
from gateway.pool_state import queue_states
from gateway.routing import announcements

MIN_REPLICAS = {Tier.HOT: 1, Tier.WARM: 0, Tier.COLD: 0}


class WorkerView(BaseModel):
    worker_id: str
    queues: list[str]
    pinned: list[str]
    warm_preloaded: list[str]
    jobs_running: int
    free_slots: int
    seen_s_ago: float
    own_queue: str | None = Field(
        default=None, description="the queue of the jobs routed to it (README, Routing)"
    )
    own_queue_depth: int = Field(default=0, description="routed jobs waiting for it")
    adapters_held: dict[str, int] = Field(
        default_factory=dict, description="adapters it holds, by level (pinned, engine, disk)"
    )


class TierView(BaseModel):
    """One tier of one base model's pool."""

    base_model: BaseModelRef
    pool: str = Field(description="the pool's id: the first 12 hex digits of the base model digest")
    tier: Tier
    queue: str
    queue_depth: int
    admitted_unfinished: int
    oldest_waiting_s: float
    workers: list[WorkerView]
    free_slots: int
    recommended_replicas: int


class Fleet(BaseModel):
    tiers: list[TierView]
    formula: str


async def fleet(redis: Redis, settings: GatewaySettings) -> Fleet:
    now = time.time()
    states = await queue_states(redis, now)
    workers = []
    for record, depth in await announcements(redis):
        running = int(record.get("jobs_running") or 0)
        held = Counter(str(level) for level in (record.get("adapters") or {}).values())
        workers.append(
            WorkerView(
                worker_id=record["worker_id"],
                queues=record.get("queues", []),
                pinned=record.get("pinned", []),
                warm_preloaded=record.get("warm_preloaded", []),
                jobs_running=running,
                free_slots=max(0, int(record.get("concurrency") or 0) - running),
                seen_s_ago=round(now - float(record["seen_at"]), 3),
                own_queue=record.get("queue"),
                own_queue_depth=depth,
                adapters_held=dict(held),
            )
        )
    tiers = []
    for state in states:
        tier = state.tier
        serving = [w for w in workers if state.queue in w.queues]
        by_load = math.ceil(state.admitted_unfinished / settings.fleet_target_jobs_per_worker)
        by_age = len(serving) + 1 if state.oldest_waiting_s > settings.fleet_max_queue_age_s else 0
        tiers.append(
            TierView(
                base_model=state.base_model,
                pool=state.pool,
                tier=tier,
                queue=state.queue,
                queue_depth=state.queue_depth,
                admitted_unfinished=state.admitted_unfinished,
                oldest_waiting_s=round(state.oldest_waiting_s, 3),
                workers=serving,
                free_slots=sum(w.free_slots for w in serving),
                recommended_replicas=max(MIN_REPLICAS[tier], by_load, by_age),
            )
        )
    formula = (
        f"max(min_replicas, ceil(admitted_unfinished / {settings.fleet_target_jobs_per_worker}),"
        f" workers + 1 if oldest_waiting_s > {settings.fleet_max_queue_age_s:g})"
    )
    return Fleet(tiers=tiers, formula=formula)
