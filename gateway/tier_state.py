"""Each tier's queue as Redis holds it right now: jobs waiting, jobs admitted and unfinished,
and how long the oldest waiting job has waited. Read by ``GET /metrics`` and ``GET /v1/fleet``
alike, in one pipelined round trip."""

from __future__ import annotations

from dataclasses import dataclass

from redis.asyncio import Redis

from contracts.keys import tier_ledger_key
from contracts.queues import Tier, queue_for
from contracts.task_messages import accepted_at as oldest_accepted_at


@dataclass(frozen=True)
class TierState:
    queue_depth: int
    admitted_unfinished: int
    oldest_waiting_s: float
    """0 when nothing waits (or the oldest message can't be read)."""


async def tier_states(redis: Redis, now: float) -> dict[Tier, TierState]:
    """Every tier's state at ``now`` (ledger entries past their expiry don't count)."""
    async with redis.pipeline(transaction=False) as pipe:
        for tier in Tier:
            pipe.llen(queue_for(tier))
            pipe.zcount(tier_ledger_key(tier.value), now, "+inf")
            pipe.lindex(queue_for(tier), -1)  # kombu pushes left and pops right
        replies = await pipe.execute()
    states = {}
    for index, tier in enumerate(Tier):
        depth, unfinished, oldest = replies[index * 3 : index * 3 + 3]
        accepted = oldest_accepted_at(oldest) if oldest is not None else None
        states[tier] = TierState(
            queue_depth=int(depth),
            admitted_unfinished=int(unfinished),
            oldest_waiting_s=max(0.0, now - accepted) if accepted else 0.0,
        )
    return states
