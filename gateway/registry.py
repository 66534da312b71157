"""Resolve an alias to its immutable registry record (read side of the registry)."""

from __future__ import annotations

from redis.asyncio import Redis

from contracts.keys import adapter_key
from contracts.registry import AdapterRecord


async def resolve_alias(redis: Redis, alias: str) -> AdapterRecord | None:
    """The record ``alias`` names, or ``None`` if no such adapter is registered."""
    raw = await redis.get(adapter_key(alias))
    if raw is None:
        return None
    return AdapterRecord.model_validate_json(raw)
