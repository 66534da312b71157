"""Resolve what a caller named (alias or channel) to one immutable registry record."""

from __future__ import annotations

from dataclasses import dataclass

from redis.asyncio import Redis

from contracts.keys import RETIRED_INDEX, adapter_key, channel_key
from contracts.registry import AdapterRecord


@dataclass(frozen=True)
class Resolved:
    """The revision a job is admitted with; ``channel`` is set when the caller named one."""

    record: AdapterRecord
    channel: str | None
    retired: bool


async def resolve(redis: Redis, name: str) -> Resolved | None:
    """Follow a channel (once) to its alias, then read that alias's record; ``None`` if absent.

    The channel is read once: the job keeps the revision resolved here even if the channel
    moves while it is queued or running.
    """
    target = await redis.get(channel_key(name))
    alias = str(target) if target is not None else name
    async with redis.pipeline(transaction=False) as pipe:
        pipe.get(adapter_key(alias))
        pipe.sismember(RETIRED_INDEX, alias)
        raw, retired = await pipe.execute()
    if raw is None:
        return None
    return Resolved(
        record=AdapterRecord.model_validate_json(raw),
        channel=name if target is not None else None,
        retired=bool(retired),
    )
