"""Who is calling, and may they use the adapter they name: one Redis round trip.

A bearer API key resolves to a tenant, or the request is refused (401). An admission asks in
the same script whether the tenant is granted the name it used and what the name resolves to
(``gateway.registry``), so a job costs one read before it is admitted. Nothing read is
cached: a revoked key, a retired alias, a moved channel take effect on the next request. What
is kept is the parse of a record's exact text (``PARSED``): the same key and tenant records
arrive with every request of a tenant (with the adapter's, ``gateway.registry``: 9.7 us a
request parsed, 0.26 us kept, in a micro-benchmark).
"""

from __future__ import annotations

import functools
from dataclasses import dataclass
from datetime import UTC, datetime
from typing import Any
from weakref import WeakKeyDictionary

import sentry_sdk
from redis.asyncio import Redis
from redis.commands.core import AsyncScript

from contracts.errors import ErrorCode
from contracts.keys import (
    RETIRED_INDEX,
    adapter_key,
    api_key_key,
    channel_key,
    grants_key,
    tenant_key,
)
from contracts.tenants import ALL_ADAPTERS, ApiKeyRecord, TenantRecord
from gateway.errors import ApiError, shown
from gateway.registry import Resolved, UnreadableAlias, resolution

_UNAUTHORIZED = (
    "A valid API key is required: send `Authorization: Bearer <key>` "
    "(create one with `lorafleet tenants create`)."
)

ACCESS = """
-- KEYS: 1 the presented key's record. ARGV: 1 tenant key prefix, 2 grants key prefix,
-- 3 channel key prefix, 4 adapter key prefix, 5 retired index, 6 the all-adapters grant,
-- 7 the name asked for ('': authenticate only).
-- Returns {} for an unknown key; {key} if it names no tenant; {key, tenant} to
-- authenticate; else also {channel target, granted (0/1), alias record, retired (0/1)}.
local key = redis.call('GET', KEYS[1])
if not key then return {} end
local ok, parsed = pcall(cjson.decode, key)
if not ok or type(parsed) ~= 'table' or type(parsed['tenant']) ~= 'string' then
  return {key}
end
local tenant = parsed['tenant']
local record = redis.call('GET', ARGV[1] .. tenant)
if not record or ARGV[7] == '' then return {key, record} end
local name = ARGV[7]
local target = redis.call('GET', ARGV[3] .. name)
local grants = redis.call('SMISMEMBER', ARGV[2] .. tenant, name, ARGV[6])
local alias = target or name
return {key, record, target, math.max(grants[1], grants[2]),
        redis.call('GET', ARGV[4] .. alias), redis.call('SISMEMBER', ARGV[5], alias)}
"""
# Key names are built in the script from these prefixes (contracts.keys stays their one
# definition); the script reads only keys of the registry and of the caller's tenant.
_PREFIXES = [
    tenant_key(""),
    grants_key(""),
    channel_key(""),
    adapter_key(""),
    RETIRED_INDEX,
    ALL_ADAPTERS,
]


_scripts: WeakKeyDictionary[Redis, AsyncScript] = WeakKeyDictionary()  # ``ACCESS`` per client

PARSED = 4096
"""Key and tenant records whose parse is kept (each by its exact text; the models are
frozen): the most recently used."""


@functools.lru_cache(maxsize=PARSED)
def _key_record(raw: str) -> ApiKeyRecord:
    return ApiKeyRecord.model_validate_json(raw)


@functools.lru_cache(maxsize=PARSED)
def _tenant_record(raw: str) -> TenantRecord:
    return TenantRecord.model_validate_json(raw)


def parsed_records() -> int:
    """How many key and tenant records were parsed (not found kept) so far."""
    return _key_record.cache_info().misses + _tenant_record.cache_info().misses


@dataclass(frozen=True)
class Caller:
    """The API key a request presents (by its hash), not yet checked."""

    key_hash: str


@dataclass(frozen=True)
class Access:
    """The caller's tenant and, if a name was asked for, what it resolves to."""

    tenant: TenantRecord
    name: str = ""
    resolved: Resolved | None = None
    """``None`` when the name does not exist or is not granted to the tenant (the two are not
    told apart), or when its record is ``unreadable``."""
    unreadable: UnreadableAlias | None = None

    def admissible(self) -> Resolved:
        """The revision a job naming ``name`` is admitted with, or the ``ApiError`` refusing
        it: 404 unknown or not granted, 410 retired, 500 an unreadable registry record."""
        if self.unreadable is not None:
            if self.unreadable.retired:
                raise retired(self.unreadable.alias)
            # The registry, not the caller, is at fault; a retry cannot help until an
            # operator retires the alias and publishes its adapter under a new one.
            raise ApiError(
                500,
                ErrorCode.ADAPTER_UNAVAILABLE,
                f"Adapter {self.unreadable.alias!r} cannot be served: its registry record is "
                "unreadable. Nothing was enqueued.",
                param="adapter",
            )
        if self.resolved is None:
            raise ApiError(
                404,
                ErrorCode.ADAPTER_NOT_FOUND,
                f"No adapter named {shown(self.name)} is available. Nothing was enqueued.",
                param="adapter",
            )
        if self.resolved.retired:
            raise retired(self.resolved.record.alias)
        return self.resolved


def retired(alias: str) -> ApiError:
    return ApiError(
        410,
        ErrorCode.ADAPTER_RETIRED,
        f"Adapter {alias!r} is retired and takes no new jobs. Nothing was enqueued.",
        param="adapter",
    )


def refused() -> ApiError:
    return ApiError(
        401, ErrorCode.UNAUTHORIZED, _UNAUTHORIZED, headers={"WWW-Authenticate": "Bearer"}
    )


async def check(redis: Redis, caller: Caller, name: str = "") -> Access:
    """The caller's tenant (401 ``ApiError`` if the key is unknown, revoked, expired or its
    tenant gone) and, if ``name`` is given, what it resolves to for that tenant. A revoked key
    is gone from Redis, so it is refused on the next request; a rotated key is refused once
    its grace period ends. Redis errors are raised as they are."""
    script = _scripts.get(redis)
    if script is None:
        script = _scripts[redis] = redis.register_script(ACCESS)
    reply: list[Any] = await script(keys=[api_key_key(caller.key_hash)], args=[*_PREFIXES, name])
    if len(reply) < 2 or reply[1] is None:
        raise refused()
    key = _key_record(reply[0])
    if key.expires_at is not None and key.expires_at <= datetime.now(tz=UTC):
        raise refused()
    tenant = _tenant_record(reply[1])
    sentry_sdk.set_tag("tenant", tenant.name)
    if not name:
        return Access(tenant)
    target, granted, raw, retired_ = reply[2:]
    try:
        resolved = resolution(name, target, bool(granted), raw, bool(retired_))
    except UnreadableAlias as unreadable:
        return Access(tenant, name, unreadable=unreadable)
    return Access(tenant, name, resolved)
