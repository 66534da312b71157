"""Registry reads a worker needs: the hot and warm adapters to preload for its base model,
and the pools (base models) the registry's adapters name."""

from __future__ import annotations

import logging

from redis import Redis

from contracts.keys import ADAPTERS_INDEX, POOLS, RETIRED_INDEX, adapter_key
from contracts.queues import Tier, pool_id
from contracts.registry import AdapterRecord, BaseModelRef, UnreadableRecord, read_record
from worker import metrics

log = logging.getLogger(__name__)


def active_records(redis: Redis, report: bool = True) -> list[AdapterRecord]:
    """Every active (not retired) record, sorted by alias.

    A record that does not parse is skipped (with ``report``, logged and counted): one bad
    record must not keep a worker from starting; its own jobs fail at admission.
    """
    aliases = sorted(str(a) for a in redis.smembers(ADAPTERS_INDEX))  # type: ignore[union-attr]
    retired = {str(a) for a in redis.smembers(RETIRED_INDEX)}  # type: ignore[union-attr]
    raws = redis.mget([adapter_key(alias) for alias in aliases]) if aliases else []
    records = []
    for alias, raw in zip(aliases, raws, strict=True):  # type: ignore[arg-type]
        if raw is None or alias in retired:
            continue
        try:
            records.append(read_record(alias, raw))
        except UnreadableRecord as exc:
            if report:
                log.error("not preloading %s", exc)
                metrics.REGISTRY_RECORDS_INVALID.inc()
    return records


def preload_sets(redis: Redis, base_digest: str) -> tuple[list[AdapterRecord], list[AdapterRecord]]:
    """Active hot and warm records for ``base_digest``, one per digest, sorted by alias."""
    by_tier: dict[Tier, dict[str, AdapterRecord]] = {Tier.HOT: {}, Tier.WARM: {}}
    for record in active_records(redis):
        if record.base_model.digest != base_digest:
            continue
        if record.tier in by_tier:
            by_tier[record.tier].setdefault(record.digest, record)
    return list(by_tier[Tier.HOT].values()), list(by_tier[Tier.WARM].values())


def record_pools(redis: Redis, served: BaseModelRef) -> None:
    """Make every pool known (``POOLS``): the one this worker serves, and those of the active
    adapters (published before pools were recorded). First writer wins: a pool's name in the
    metrics' ``base_model`` label never changes once exported."""
    bases = {served.digest: served}
    for record in active_records(redis, report=False):  # preloading reports them
        bases.setdefault(record.base_model.digest, record.base_model)
    pipe = redis.pipeline(transaction=False)
    for digest, base in bases.items():
        pipe.hsetnx(POOLS, pool_id(digest), base.model_dump_json())
    pipe.execute()
