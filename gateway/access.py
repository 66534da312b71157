"""Who is calling, and may they use the adapter they name: one Redis round trip, or none.

A bearer API key resolves to a tenant, or the request is refused (401). An admission asks in
the same script whether the tenant is granted the name it used and what the name resolves to
(``gateway.registry``), so a job costs at most one read before it is admitted. What is kept
of a read is the parse of a record's exact text (``PARSED``): the same key and tenant records
arrive with every request of a tenant (with the adapter's, ``gateway.registry``: 9.7 us a
request parsed, 0.26 us kept, in a micro-benchmark).

A request that admits a job need not read its access at all (``recall``): a process keeps the
named accesses it last read that admit (``RECALLED``), and the admission script checks, in the
step that admits, that Redis still holds exactly what was read then (``ADMIT``, the
``Recalled`` witness); if anything changed (a revoked or rotated key, a tenant's limits, a
grant, a moved channel, a retired alias) nothing is written and the gateway reads the access
again and decides on that. So a revoked key, a retired alias, a moved channel still take
effect on the next request, in one round trip fewer for every request they do not concern.
Until the admission has checked it, a recalled access is ``Unconfirmed``: a refusal decided
on it before (a prompt too long for the recalled adapter's model, an idempotency replay) first
reads the access again (``gateway.submit.Submitter.submit``: the key's or name's own refusal
first, a changed access submitted again on what was read), and a client error the route
answers (an invalid body) first confirms the key (the error handlers), so a bad key is 401
whatever the body holds; a server error (5xx) from the handlers is answered as it is.
"""

from __future__ import annotations

import asyncio
import functools
from collections import OrderedDict
from dataclasses import dataclass, field
from datetime import UTC, datetime
from typing import Any
from weakref import WeakKeyDictionary

import sentry_sdk
from redis.asyncio import Redis
from redis.commands.core import AsyncScript
from redis.exceptions import RedisError

from contracts.admission import ACCESS_PREFIXES, READ_ACCESS_LUA, Recalled, witness
from contracts.errors import ErrorCode
from contracts.keys import api_key_key
from contracts.tenants import ApiKeyRecord, TenantRecord
from gateway.errors import ApiError, shown, unavailable
from gateway.registry import Resolved, UnreadableAlias, resolution

_UNAUTHORIZED = (
    "A valid API key is required: send `Authorization: Bearer <key>` "
    "(create one with `lorafleet tenants create`)."
)

NOT_AUTHENTICATED = "The request could not be authenticated: {what} ({exc}); retry."

ACCESS = (
    READ_ACCESS_LUA
    + """
-- KEYS: 1 the presented key's record. ARGV: 1-6 ACCESS_PREFIXES, 7 the name asked for
-- ('': authenticate only).
return read_access(KEYS[1], {unpack(ARGV, 1, 6)}, ARGV[7])
"""
)
"""``contracts.admission.read_access`` of the presented key, as its own script."""


_scripts: WeakKeyDictionary[Redis, AsyncScript] = WeakKeyDictionary()  # ``ACCESS`` per client

RECALLED = 4096
"""Named accesses that admit kept per process (per Redis client) for ``recall``: the most
recently used."""

_recalled: WeakKeyDictionary[Redis, OrderedDict[tuple[str, str], _Kept]] = WeakKeyDictionary()

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


@dataclass(eq=False)
class Unconfirmed:
    """This request's access was recalled, not read (``recall``): the admission script checks
    it against ``recalled``; until something has confirmed the key, an error answered to the
    request must first confirm it (``refusal``)."""

    recalled: Recalled
    caller: Caller
    redis: Redis
    timeout_s: float
    confirmed: bool = False
    """Redis was read for this request's key (an admission checked the witness, or
    ``refusal`` or ``reread`` read it again)."""

    async def refusal(self) -> ApiError | None:
        """What to answer instead of an error to this request: ``None`` if its key is good
        (or was confirmed already), else the 401 (or a 503 if the key store does not answer
        within the bound)."""
        if self.confirmed:
            return None
        try:
            async with asyncio.timeout(self.timeout_s):
                await check(self.redis, self.caller)
        except ApiError as refusal:
            self.confirmed = True
            return refusal
        except (RedisError, OSError, TimeoutError) as exc:
            return unavailable("the key store is unreachable", exc, NOT_AUTHENTICATED)
        self.confirmed = True
        return None

    async def reread(self) -> Access:
        """The access the recalled one became, key and name read again (and kept, replacing
        the one recalled); the key is then confirmed, admitted or refused (401 ``ApiError``).
        Redis errors are raised as they are."""
        forget(self.redis, self.caller, self.recalled.name)
        try:
            access = await check(self.redis, self.caller, self.recalled.name, keep=True)
        except ApiError:
            self.confirmed = True
            raise
        self.confirmed = True
        return access


@dataclass(frozen=True)
class Access:
    """The caller's tenant and, if a name was asked for, what it resolves to."""

    tenant: TenantRecord
    name: str = ""
    resolved: Resolved | None = None
    """``None`` when the name does not exist or is not granted to the tenant (the two are not
    told apart), or when its record is ``unreadable``."""
    unreadable: UnreadableAlias | None = None
    unconfirmed: Unconfirmed | None = field(default=None, compare=False)
    """Set when this access was recalled, not read, for this request."""

    def admissible(self, param: str = "adapter") -> Resolved:
        """The revision a job naming ``name`` is admitted with, or the ``ApiError`` refusing
        it: 404 unknown or not granted, 410 retired, 500 an unreadable registry record.
        ``param``: the request field that named it (``model`` on the OpenAI endpoints)."""
        if self.unreadable is not None:
            if self.unreadable.retired:
                raise retired(self.unreadable.alias, param)
            # The registry, not the caller, is at fault; a retry cannot help until an
            # operator retires the alias and publishes its adapter under a new one.
            raise ApiError(
                500,
                ErrorCode.ADAPTER_UNAVAILABLE,
                f"Adapter {self.unreadable.alias!r} cannot be served: its registry record is "
                "unreadable. Nothing was enqueued.",
                param=param,
            )
        if self.resolved is None:
            raise ApiError(
                404,
                ErrorCode.ADAPTER_NOT_FOUND,
                f"No adapter named {shown(self.name)} is available. Nothing was enqueued.",
                param=param,
            )
        if self.resolved.retired:
            raise retired(self.resolved.record.alias, param)
        return self.resolved


def retired(alias: str, param: str = "adapter") -> ApiError:
    return ApiError(
        410,
        ErrorCode.ADAPTER_RETIRED,
        f"Adapter {alias!r} is retired and takes no new jobs. Nothing was enqueued.",
        param=param,
    )


def refused() -> ApiError:
    return ApiError(
        401, ErrorCode.UNAUTHORIZED, _UNAUTHORIZED, headers={"WWW-Authenticate": "Bearer"}
    )


@dataclass(frozen=True)
class _Kept:
    access: Access
    recalled: Recalled
    expires_at: datetime | None
    """The key's own expiry (a rotated key's grace), checked at each recall."""


async def check(redis: Redis, caller: Caller, name: str = "", keep: bool = False) -> Access:
    """The caller's tenant (401 ``ApiError`` if the key is unknown, revoked, expired or its
    tenant gone) and, if ``name`` is given, what it resolves to for that tenant. A revoked key
    is gone from Redis, so it is refused on the next request; a rotated key is refused once
    its grace period ends. Redis errors are raised as they are. ``keep``: an access that
    admits is kept for ``recall``."""
    script = _scripts.get(redis)
    if script is None:
        script = _scripts[redis] = redis.register_script(ACCESS)
    key_name = api_key_key(caller.key_hash)
    reply: list[Any] = await script(keys=[key_name], args=[*ACCESS_PREFIXES, name])
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
    access = Access(tenant, name, resolved)
    if keep and resolved is not None and not resolved.retired:
        kept = _recalled.get(redis)
        if kept is None:
            kept = _recalled[redis] = OrderedDict()
        recalled = Recalled(key_name, name, witness(reply))
        kept[caller.key_hash, name] = _Kept(access, recalled, key.expires_at)
        kept.move_to_end((caller.key_hash, name))
        while len(kept) > RECALLED:
            kept.popitem(last=False)
    return access


async def recall(redis: Redis, caller: Caller, name: str, timeout_s: float) -> Access:
    """``check`` for a request that admits a job naming ``name``: an access this process read
    before and that admitted is recalled instead of read (no round trip; ``Unconfirmed``,
    whose witness the admission checks), unless the key's own expiry has passed; else it is
    read (within ``timeout_s``) and kept."""
    kept = _recalled.get(redis)
    entry = kept.get((caller.key_hash, name)) if kept is not None and name else None
    if entry is not None:
        assert kept is not None
        if entry.expires_at is None or entry.expires_at > datetime.now(tz=UTC):
            kept.move_to_end((caller.key_hash, name))
            sentry_sdk.set_tag("tenant", entry.access.tenant.name)
            unconfirmed = Unconfirmed(entry.recalled, caller, redis, timeout_s)
            access = entry.access
            return Access(access.tenant, name, access.resolved, unconfirmed=unconfirmed)
        del kept[caller.key_hash, name]
    async with asyncio.timeout(timeout_s):
        return await check(redis, caller, name, keep=True)


def forget(redis: Redis, caller: Caller, name: str) -> None:
    """Recall ``caller``'s access to ``name`` no more (the admission found it changed)."""
    kept = _recalled.get(redis)
    if kept is not None:
        kept.pop((caller.key_hash, name), None)
