"""Each pool queue (one tier of one base model's pool) as Redis holds it right now: jobs
waiting, jobs admitted and unfinished, and how long the oldest waiting job has waited. Read by
``GET /metrics`` and ``GET /v1/fleet`` alike: the pools (``contracts.keys.POOLS``), then every
pool queue's state in one pipelined round trip."""

from __future__ import annotations

import json
from dataclasses import dataclass

from redis.asyncio import Redis

from contracts.keys import POOLS, queue_ledger_key
from contracts.queues import Tier, pool_id, queue_for
from contracts.registry import BaseModelRef
from contracts.task_messages import accepted_at as oldest_accepted_at


@dataclass(frozen=True)
class QueueState:
    base_model: BaseModelRef
    pool: str
    """``contracts.queues.pool_id`` of the base model."""
    tier: Tier
    queue: str
    queue_depth: int
    admitted_unfinished: int
    oldest_waiting_s: float
    """0 when nothing waits (or the oldest message can't be read)."""


async def pools(redis: Redis) -> list[BaseModelRef]:
    """Every known pool's base model, by base model id then digest (an entry that does not
    parse is skipped: it names no queue a job can be admitted to)."""
    found = []
    for raw in (await redis.hgetall(POOLS)).values():  # type: ignore[misc]
        try:
            found.append(BaseModelRef.model_validate(json.loads(raw)))
        except ValueError:
            continue
    return sorted(found, key=lambda base: (base.id, base.digest))


async def queue_states(redis: Redis, now: float) -> list[QueueState]:
    """Every pool queue's state at ``now`` (ledger entries past their expiry don't count),
    by pool then tier."""
    bases = await pools(redis)
    async with redis.pipeline(transaction=False) as pipe:
        for base in bases:
            for tier in Tier:
                queue = queue_for(tier, base.digest)
                pipe.llen(queue)
                pipe.zcount(queue_ledger_key(queue), now, "+inf")
                pipe.lindex(queue, -1)  # kombu pushes left and pops right
        replies = await pipe.execute()
    states = []
    index = 0
    for base in bases:
        for tier in Tier:
            depth, unfinished, oldest = replies[index : index + 3]
            index += 3
            accepted = oldest_accepted_at(oldest) if oldest is not None else None
            states.append(
                QueueState(
                    base_model=base,
                    pool=pool_id(base.digest),
                    tier=tier,
                    queue=queue_for(tier, base.digest),
                    queue_depth=int(depth),
                    admitted_unfinished=int(unfinished),
                    oldest_waiting_s=max(0.0, now - accepted) if accepted else 0.0,
                )
            )
    return states
