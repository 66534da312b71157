"""Registry reads a worker needs: the hot and warm adapters to preload for its base model."""

from __future__ import annotations

import logging

from redis import Redis

from contracts.keys import ADAPTERS_INDEX, RETIRED_INDEX, adapter_key
from contracts.queues import Tier
from contracts.registry import AdapterRecord, UnreadableRecord, read_record
from worker import metrics

log = logging.getLogger(__name__)


def preload_sets(redis: Redis, base_digest: str) -> tuple[list[AdapterRecord], list[AdapterRecord]]:
    """Active hot and warm records for ``base_digest``, one per digest, sorted by alias.

    A record that does not parse is skipped (logged and counted): one bad record must not
    keep a worker from starting; its own jobs fail at admission.
    """
    aliases = sorted(str(a) for a in redis.smembers(ADAPTERS_INDEX))  # type: ignore[union-attr]
    retired = {str(a) for a in redis.smembers(RETIRED_INDEX)}  # type: ignore[union-attr]
    raws = redis.mget([adapter_key(alias) for alias in aliases]) if aliases else []
    by_tier: dict[Tier, dict[str, AdapterRecord]] = {Tier.HOT: {}, Tier.WARM: {}}
    for alias, raw in zip(aliases, raws, strict=True):  # type: ignore[arg-type]
        if raw is None or alias in retired:
            continue
        try:
            record = read_record(alias, raw)
        except UnreadableRecord as exc:
            log.error("not preloading %s", exc)
            metrics.REGISTRY_RECORDS_INVALID.inc()
            continue
        if record.base_model.digest != base_digest:
            continue
        if record.tier in by_tier:
            by_tier[record.tier].setdefault(record.digest, record)
    return list(by_tier[Tier.HOT].values()), list(by_tier[Tier.WARM].values())
