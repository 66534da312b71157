"""Registry management (CLI side): aliases, retirement and channels, stored in Redis.

Every change is one Lua script, so two operators racing cannot leave a half-made state:
an alias is never also a channel, a channel never points at a missing or retired alias.
A record that does not parse (another version's, or written by hand) is reported as an
``UnreadableRecord``, never a crash: it can still be listed, shown and retired.
"""

from __future__ import annotations

import json
import re

from redis import Redis

from contracts.errors import ErrorCode
from contracts.keys import (
    ADAPTERS_INDEX,
    CHANNELS_INDEX,
    POOLS,
    REGISTRY_VERSION,
    RETIRED_INDEX,
    WORKERS_INDEX,
    adapter_key,
    channel_key,
    worker_key,
)
from contracts.queues import Tier, pool_id, queue_for
from contracts.registry import (
    SLUG_PATTERN,
    AdapterRecord,
    BaseModelRef,
    UnreadableRecord,
    read_record,
)

Entry = AdapterRecord | UnreadableRecord
"""What an alias's key holds: a record, or the reason it does not parse."""

_REGISTER = """
if redis.call('EXISTS', KEYS[2]) == 1 then return {'name_taken'} end
local existing = redis.call('GET', KEYS[1])
if existing then return {'exists', existing} end
redis.call('SET', KEYS[1], ARGV[1])
redis.call('SADD', KEYS[3], ARGV[2])
redis.call('HSETNX', KEYS[4], ARGV[3], ARGV[4])
redis.call('INCR', KEYS[5])
return {'ok'}
"""

_SET_CHANNEL = """
if redis.call('EXISTS', KEYS[2]) == 1 then return 'name_taken' end
if redis.call('EXISTS', KEYS[3]) == 0 then return 'adapter_not_found' end
if redis.call('SISMEMBER', KEYS[4], ARGV[2]) == 1 then return 'adapter_retired' end
local previous = redis.call('GET', KEYS[1])
redis.call('SET', KEYS[1], ARGV[2])
redis.call('SADD', KEYS[5], ARGV[1])
return previous or ''
"""


class RegistryError(Exception):
    """A registry change was refused; nothing changed. ``code`` is stable."""

    def __init__(self, code: ErrorCode, message: str) -> None:
        super().__init__(message)
        self.code = code
        self.message = message


def check_name(name: str, what: str) -> None:
    """Refuse names that are not a safe slug (path separators, dots-only, control chars...)."""
    if not re.fullmatch(SLUG_PATTERN, name):
        raise RegistryError(
            ErrorCode.NAME_INVALID,
            f"{what} {name!r} is not a valid name: use 1-64 lowercase letters, digits, '.', "
            "'_' or '-', starting and ending with a letter or digit.",
        )


class Registry:
    """Synchronous registry operations for the CLI and the local tools."""

    def __init__(self, redis: Redis) -> None:
        self._redis = redis
        self._register = redis.register_script(_REGISTER)
        self._set_channel = redis.register_script(_SET_CHANNEL)

    def register(self, record: AdapterRecord) -> AdapterRecord:
        """Register ``record``; the same digest again is a no-op, other bytes are refused.
        Its base model's pool is recorded (``POOLS``): the gateways report and scale it from
        then on, before any worker of it has started."""
        outcome = self._register(
            keys=[
                adapter_key(record.alias),
                channel_key(record.alias),
                ADAPTERS_INDEX,
                POOLS,
                REGISTRY_VERSION,
            ],
            args=[
                record.model_dump_json(),
                record.alias,
                pool_id(record.base_model.digest),
                record.base_model.model_dump_json(),
            ],
        )
        status = _text(outcome[0])
        if status == "name_taken":
            raise RegistryError(
                ErrorCode.NAME_TAKEN, f"{record.alias!r} is already a channel name."
            )
        if status == "exists":
            existing = _entry(record.alias, outcome[1])
            if isinstance(existing, UnreadableRecord) or existing.digest != record.digest:
                raise RegistryError(
                    ErrorCode.ALIAS_EXISTS,
                    f"Alias {record.alias!r} already names {_described(existing)}; publish "
                    "new bytes under a new alias.",
                )
            return existing
        return record

    def get(self, alias: str) -> Entry | None:
        """The record of ``alias`` (or why it does not parse); ``None`` if there is none."""
        raw = self.stored(alias)
        return None if raw is None else _entry(alias, raw)

    def stored(self, alias: str) -> str | None:
        """The text stored under ``alias``'s key, parsed or not."""
        raw = self._redis.get(adapter_key(alias))
        return None if raw is None else _text(raw)

    def require(self, alias: str) -> Entry:
        entry = self.get(alias)
        if entry is None:
            raise RegistryError(ErrorCode.ADAPTER_NOT_FOUND, f"No adapter named {alias!r}.")
        return entry

    def list(self) -> list[Entry]:
        """Every registered alias's entry, sorted by alias."""
        aliases = sorted(_text(a) for a in self._redis.smembers(ADAPTERS_INDEX))  # type: ignore[union-attr]
        entries = (self.get(alias) for alias in aliases)
        return [entry for entry in entries if entry is not None]

    def pin_room(self, base_digest: str) -> tuple[int, dict[str, str]] | None:
        """How many hot adapters the live workers of ``base_digest`` that take the hot queue
        can pin (the fewest of them: ``max_loras`` - 1, one slot stays free for the rest),
        and the active hot adapters of that base model now (digest -> an alias naming it);
        ``None`` while no such worker announces itself (nothing to check against)."""
        ids = [_text(i) for i in self._redis.smembers(WORKERS_INDEX)]  # type: ignore[union-attr]
        raws = self._redis.mget([worker_key(i) for i in ids]) if ids else []
        slots = []
        for raw in raws:  # type: ignore[union-attr]
            if raw is None:
                continue
            try:
                worker = json.loads(_text(raw))
                serves = (worker.get("base_model") or {}).get("digest") == base_digest
                if serves and queue_for(Tier.HOT, base_digest) in (worker.get("queues") or ()):
                    slots.append(int(worker["max_loras"]))
            except (ValueError, KeyError, TypeError, AttributeError):
                continue  # an announcement of another version: not counted
        if not slots:
            return None
        retired = self.retired()
        hot: dict[str, str] = {}
        for entry in self.list():
            if isinstance(entry, UnreadableRecord) or entry.alias in retired:
                continue
            if entry.tier == Tier.HOT and entry.base_model.digest == base_digest:
                hot.setdefault(entry.digest, entry.alias)
        return min(slots) - 1, hot

    def pools(self) -> dict[str, BaseModelRef]:
        """Pool id -> base model of every known pool (``POOLS``), by pool id; an entry that
        does not parse is left out."""
        found = {}
        for key, raw in self._redis.hgetall(POOLS).items():  # type: ignore[union-attr]
            try:
                found[_text(key)] = BaseModelRef.model_validate_json(_text(raw))
            except ValueError:
                continue
        return dict(sorted(found.items()))

    def retired(self) -> set[str]:
        return {_text(a) for a in self._redis.smembers(RETIRED_INDEX)}  # type: ignore[union-attr]

    def retire(self, alias: str) -> Entry:
        """Stop new admissions for ``alias``; queued jobs keep their revision. An unreadable
        record can be retired too: that is how an operator takes it out of service."""
        entry = self.require(alias)
        pipe = self._redis.pipeline()
        pipe.sadd(RETIRED_INDEX, alias)
        pipe.incr(REGISTRY_VERSION)  # live workers unpin it if it was a hot adapter
        pipe.execute()
        return entry

    def set_channel(self, name: str, alias: str) -> str | None:
        """Point channel ``name`` at ``alias``; returns the alias it pointed to before."""
        check_name(name, "Channel")
        outcome = _text(
            self._set_channel(
                keys=[
                    channel_key(name),
                    adapter_key(name),
                    adapter_key(alias),
                    RETIRED_INDEX,
                    CHANNELS_INDEX,
                ],
                args=[name, alias],
            )
        )
        if outcome == "name_taken":
            raise RegistryError(ErrorCode.NAME_TAKEN, f"{name!r} is already an adapter alias.")
        if outcome == "adapter_not_found":
            raise RegistryError(ErrorCode.ADAPTER_NOT_FOUND, f"No adapter named {alias!r}.")
        if outcome == "adapter_retired":
            raise RegistryError(ErrorCode.ADAPTER_RETIRED, f"Adapter {alias!r} is retired.")
        return outcome or None

    def channel(self, name: str) -> str | None:
        raw = self._redis.get(channel_key(name))
        return None if raw is None else _text(raw)

    def channels(self) -> dict[str, str]:
        names = sorted(_text(n) for n in self._redis.smembers(CHANNELS_INDEX))  # type: ignore[union-attr]
        return {name: target for name in names if (target := self.channel(name)) is not None}


def _entry(alias: str, raw: object) -> Entry:
    try:
        return read_record(alias, _text(raw))
    except UnreadableRecord as exc:
        return exc


def _described(entry: Entry) -> str:
    """The digest of a record, or what is wrong with an unreadable one (for messages)."""
    if isinstance(entry, UnreadableRecord):
        return f"an unreadable record ({entry.reason})"
    return entry.digest


def _text(value: object) -> str:
    return value.decode() if isinstance(value, bytes) else str(value)
