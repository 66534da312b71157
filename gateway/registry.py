"""Resolve what a caller named (alias or channel) to one immutable registry record, if the
caller's tenant is granted that name."""

from __future__ import annotations

import functools
import logging
from dataclasses import dataclass

from redis.asyncio import Redis

from contracts.keys import (
    ADAPTERS_INDEX,
    CHANNELS_INDEX,
    RETIRED_INDEX,
    adapter_key,
    channel_key,
    grants_key,
)
from contracts.registry import AdapterRecord, UnreadableRecord, read_record
from contracts.tenants import ALL_ADAPTERS
from gateway.metrics import REGISTRY_RECORDS_INVALID

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class Resolved:
    """The revision a job is admitted with; ``channel`` is set when the caller named one."""

    record: AdapterRecord
    channel: str | None
    retired: bool


class UnreadableAlias(Exception):
    """A granted name leads to ``alias``, whose registry record does not parse."""

    def __init__(self, alias: str, reason: str, retired: bool) -> None:
        super().__init__(f"registry record of {alias!r} is unreadable: {reason}")
        self.alias = alias
        self.reason = reason
        self.retired = retired


def resolution(
    name: str, target: str | None, granted: bool, raw: str | None, retired: bool
) -> Resolved | None:
    """What ``name`` resolves to for a tenant, from what ``gateway.access.ACCESS`` read in one
    round trip: the channel's ``target`` alias (``None``: ``name`` is an alias), whether the
    tenant is ``granted`` ``name`` (or every adapter), the alias's ``raw`` record and whether
    it is ``retired``. ``None`` if absent or not granted: a caller can't tell the two apart,
    not even by timing (both paths cost the same script).

    The grant is on the name the caller used: granting a channel lets the tenant follow it
    wherever it points, without granting the aliases behind it by name. The channel is read
    once: the job keeps the revision resolved here even if the channel moves later.

    Raises ``UnreadableAlias`` (logged and counted) if the granted alias's record does not
    parse.
    """
    if raw is None or not granted:
        return None
    alias = target if target is not None else name
    try:
        record = _read_record(alias, raw)
    except UnreadableRecord as exc:
        _skipped(exc, "refusing its jobs")
        raise UnreadableAlias(alias, exc.reason, retired) from exc
    return Resolved(record=record, channel=name if target is not None else None, retired=retired)


_read_record = functools.lru_cache(maxsize=4096)(read_record)
"""``read_record``, its result kept by alias and exact text (records are frozen; one that does
not parse raises each time): every job names an adapter whose record arrives with it."""


async def granted_models(redis: Redis, tenant: str) -> list[tuple[str, AdapterRecord]]:
    """Every alias and channel ``tenant`` may use now, sorted by name, each with the record
    it resolves to. Retired aliases are excluded, and so are channels pointing at one: a job
    naming either is refused (``adapter_retired``). Names whose record does not parse are left
    out (logged and counted): one bad record must not hide the others."""
    async with redis.pipeline(transaction=False) as pipe:
        pipe.smembers(grants_key(tenant))
        pipe.smembers(ADAPTERS_INDEX)
        pipe.smembers(CHANNELS_INDEX)
        pipe.smembers(RETIRED_INDEX)
        grants, aliases, channels, retired = await pipe.execute()
    live = (set(aliases) - set(retired)) | set(channels)
    names = sorted(live if ALL_ADAPTERS in grants else live & set(grants))
    async with redis.pipeline(transaction=False) as pipe:
        for name in names:
            pipe.get(channel_key(name))
        targets = await pipe.execute()
    usable = [
        (name, str(target) if target is not None else name)
        for name, target in zip(names, targets, strict=True)
    ]
    usable = [(name, alias) for name, alias in usable if alias not in retired]
    async with redis.pipeline(transaction=False) as pipe:
        for _, alias in usable:
            pipe.get(adapter_key(alias))
        raws = await pipe.execute()
    models = []
    for (name, alias), raw in zip(usable, raws, strict=True):
        if raw is None:
            continue
        try:
            models.append((name, read_record(alias, raw)))
        except UnreadableRecord as exc:
            _skipped(exc, f"not listing {name!r}")
    return models


def _skipped(exc: UnreadableRecord, outcome: str) -> None:
    log.error("%s; %s", exc, outcome)
    REGISTRY_RECORDS_INVALID.inc()
