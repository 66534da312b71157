"""Admission ledger: how many jobs are admitted and unfinished, per pool queue and per tenant.

A pool queue is one tier of one base model's pool (``contracts.queues.queue_for``): its
ledger is what the tier's limit holds and what its pool scales on.

Each ledger is a sorted set ``job id -> expiry`` (unix seconds). Admission (``ADMIT``) checks
every limit and, only if all pass, records the job in both ledgers, takes a token from the
tenant's rate bucket and writes the job record: one script, so 50 concurrent submissions
against a limit of 20 admit exactly 20. The job leaves both ledgers when it reaches a
terminal state (``contracts.job_records.ADVANCE`` removes it in the same script that writes
the outcome, so the release happens once however often the job is delivered). A sorted set,
not a counter: removing a job twice is harmless, a count can't go negative, and an entry whose
job can no longer finish (its record expired, no worker ever came) drops out at its expiry,
``deadline + LEDGER_GRACE_S``, instead of holding a slot forever. Admission also indexes the
job by its deadline (``DEADLINES``), for the sweeper that ends jobs no worker finished
(``worker.sweeper``); the terminal write removes it there too.
"""

from __future__ import annotations

from dataclasses import dataclass
from enum import StrEnum

from contracts.batches import BatchLine, BatchRecord
from contracts.errors import ErrorCode
from contracts.job_records import WITHDRAWN, WITHDRAWN_TTL_S
from contracts.jobs import JobPublic
from contracts.keys import (
    DEADLINES,
    NO_KEY,
    RETIRED_INDEX,
    STREAM_OPENED,
    STREAM_OPENED_ID,
    STREAM_TTL_S,
    adapter_key,
    batch_jobs_key,
    batch_key,
    channel_key,
    grants_key,
    job_key,
    queue_ledger_key,
    rate_key,
    routed_key,
    stream_key,
    tenant_key,
    tenant_ledger_key,
)
from contracts.queues import Tier
from contracts.tenants import ALL_ADAPTERS

LEDGER_GRACE_S = 60.0
"""A job still unfinished this long after its deadline no longer counts against limits."""

REFUSE_WHEN_FULL = "#!lua\n"
"""A script's first line: Redis (7+) refuses the whole script while it is over ``maxmemory``
(``noeviction``). Without it a script runs once its first write command was let through
(any write, even one that frees memory), then pushes the rest past the limit."""

TAKE_TOKEN_LUA = """
local function take_token(key, rate, burst, now)
  local bucket = redis.call('HMGET', key, 'tokens', 'at')
  local tokens = tonumber(bucket[1]) or burst
  local at = tonumber(bucket[2]) or now
  tokens = math.min(burst, tokens + math.max(0, now - at) * rate)
  if tokens < 1 then return (1 - tokens) / rate end
  redis.call('HSET', key, 'tokens', tostring(tokens - 1), 'at', tostring(now))
  redis.call('EXPIRE', key, math.ceil(burst / rate) + 1)
  return nil
end
"""
"""Lua: take one token from a tenant's bucket (refilled at ``rate``/s up to ``burst``);
``nil`` if taken, else the seconds until one is there."""

_WITHDRAWN_LUA = (
    f"local WITHDRAWN = '{WITHDRAWN}'\n"
    f"local STREAM_OPENED, STREAM_OPENED_ID = '{STREAM_OPENED}', '{STREAM_OPENED_ID}'\n"
    f"local STREAM_TTL_S = {STREAM_TTL_S}\n"
)

READ_ACCESS_LUA = """
local function read_access(key_name, prefix, name)
  local key = redis.call('GET', key_name)
  if not key then return {} end
  local ok, parsed = pcall(cjson.decode, key)
  if not ok or type(parsed) ~= 'table' or type(parsed['tenant']) ~= 'string' then
    return {key}
  end
  local tenant = parsed['tenant']
  local record = redis.call('GET', prefix[1] .. tenant)
  if not record or name == '' then return {key, record} end
  local target = redis.call('GET', prefix[3] .. name)
  local grants = redis.call('SMISMEMBER', prefix[2] .. tenant, name, prefix[6])
  local alias = target or name
  return {key, record, target, math.max(grants[1], grants[2]),
          redis.call('GET', prefix[4] .. alias), redis.call('SISMEMBER', prefix[5], alias)}
end
"""
"""Lua: what decides a caller's access, read in one step (``gateway.access.ACCESS``; ``ADMIT``
reads it again for a recalled access). ``read_access(the presented key's record's key,
ACCESS_PREFIXES as a table, the name asked for ('': authenticate only))`` returns ``{}`` for
an unknown key; ``{key}`` if it names no tenant; ``{key, tenant}`` to authenticate; else also
``{channel target, granted (0/1), alias record, retired (0/1)}``. Absent keys read ``false``."""

ACCESS_PREFIXES: list[str] = [
    tenant_key(""),
    grants_key(""),
    channel_key(""),
    adapter_key(""),
    RETIRED_INDEX,
    ALL_ADAPTERS,
]
"""The key prefixes ``read_access`` builds names from (``contracts.keys`` stays their one
definition): only keys of the registry and of the caller's tenant are read."""

ACCESS_READS = 6
"""What a named access reads (``read_access``'s reply to a key that names a tenant that
exists): the witness a recalled access carries to ``ADMIT``."""


@dataclass(frozen=True)
class Recalled:
    """An access as the gateway last read it, for ``ADMIT`` to check again."""

    key: str
    """The presented key's record's key (``api_key_key``)."""
    name: str
    """The name the caller asked for."""
    witness: tuple[str, ...]
    """``witness`` of what ``read_access`` returned then (``ACCESS_READS`` values)."""


def witness(reply: list[str | int | None]) -> tuple[str, ...]:
    """``read_access``'s reply as ``ADMIT`` compares it: each value after ``=``, an absent one
    as the empty string (so an empty value and none are told apart)."""
    return tuple("" if value is None else f"={value}" for value in reply)


ADMIT = (
    REFUSE_WHEN_FULL
    + TAKE_TOKEN_LUA
    + READ_ACCESS_LUA
    + _WITHDRAWN_LUA
    + f"local NO_KEY, ACCESS_READS = '{NO_KEY}', {ACCESS_READS}\n"
    + """
-- Run again (a client retrying after its reply was lost): admitted already, and only once;
-- or withdrawn meanwhile (this copy waited in Redis's input after its caller gave up).
local was = redis.call('HGET', KEYS[4], 'status')
if was == WITHDRAWN then return {'withdrawn', '0'} end
if was then return {'admitted', '0'} end
-- A recalled access (the gateway did not read it for this request): admitted only if what
-- decides it is still exactly what the gateway read when it was last read; else nothing is
-- written and the gateway reads it again.
if KEYS[9] and KEYS[9] ~= NO_KEY then
  local now_read = read_access(KEYS[9], {unpack(ARGV, 15, 20)}, ARGV[21])
  for i = 1, ACCESS_READS do
    local value = now_read[i]
    local seen = ''
    if value then seen = '=' .. value end
    if seen ~= ARGV[21 + i] then return {'changed', '0'} end
  end
end
local now_t = redis.call('TIME')
local now = tonumber(now_t[1]) + tonumber(now_t[2]) / 1e6
redis.call('ZREMRANGEBYSCORE', KEYS[1], '-inf', now)
redis.call('ZREMRANGEBYSCORE', KEYS[2], '-inf', now)
if redis.call('ZCARD', KEYS[1]) >= tonumber(ARGV[3]) then return {'tier', '0'} end
if redis.call('ZCARD', KEYS[2]) >= tonumber(ARGV[4]) then return {'tenant', '0'} end
local wait = take_token(KEYS[3], tonumber(ARGV[5]), tonumber(ARGV[6]), now)
if wait then return {'rate', tostring(wait)} end
redis.call('ZADD', KEYS[1], ARGV[2], ARGV[1])
redis.call('ZADD', KEYS[2], ARGV[2], ARGV[1])
redis.call('ZADD', KEYS[5], ARGV[10], ARGV[1])
redis.call('HSET', KEYS[4], 'status', ARGV[7], 'record', ARGV[8], 'attempts', 0)
if ARGV[12] ~= '' then
  -- Routed to a worker's own queue: its message is kept until a worker receives it.
  redis.call('HSET', KEYS[4], 'message', ARGV[12])
  redis.call('ZREMRANGEBYSCORE', KEYS[7], '-inf', now)
  redis.call('ZADD', KEYS[7], ARGV[10], ARGV[1])
end
redis.call('EXPIRE', KEYS[4], ARGV[9])
if ARGV[13] == '1' then
  -- Its caller streams: the stream exists from now on, so the job's end is always marked.
  redis.call('XADD', KEYS[8], STREAM_OPENED_ID, STREAM_OPENED, '1')
  redis.call('EXPIRE', KEYS[8], math.min(tonumber(ARGV[9]), STREAM_TTL_S))
end
-- Its caller waits on one gateway: the final record is published there (``ADVANCE``).
if ARGV[14] and ARGV[14] ~= '' then redis.call('HSET', KEYS[4], 'reply', ARGV[14]) end
if ARGV[11] ~= '' then redis.call('LPUSH', KEYS[6], ARGV[11]) end
return {'admitted', '0'}
"""
)
"""Admit one job: with a recalled access (``Recalled``: ``KEYS[9]``, ``ARGV[15..27]``),
first check that what decides it is unchanged (``changed``, nothing written, if not); check
the tier, tenant and rate limits, and only if all pass take its
ledger slots and a token, write its record, open its stream if its caller streams
(``STREAM_OPENED``, kept as long as the record or ``STREAM_TTL_S``, the shorter) and, when the
queue lives in the same Redis, push its message (``contracts.task_messages``): admitted and
enqueued in one step."""

WITHDRAW = """
-- The job's key becomes a tombstone, so that an ADMIT of it still on its way is refused.
redis.call('DEL', KEYS[4])
redis.call('HSET', KEYS[4], 'status', ARGV[3])
redis.call('EXPIRE', KEYS[4], ARGV[4])
local removed = redis.call('ZREM', KEYS[1], ARGV[1])
redis.call('ZREM', KEYS[2], ARGV[1])
redis.call('ZREM', KEYS[5], ARGV[1])
redis.call('DEL', KEYS[6])
if removed == 1 and redis.call('EXISTS', KEYS[3]) == 1 then
  local tokens = tonumber(redis.call('HGET', KEYS[3], 'tokens')) or 0
  redis.call('HSET', KEYS[3], 'tokens', tostring(math.min(tonumber(ARGV[2]), tokens + 1)))
end
return removed
"""
"""Undo an admission whose reply was lost or whose enqueue failed: no record, no stream,
no ledger entry, the token refunded, and the job id closed to a late ``ADMIT`` (a message already
pushed finds no record and is dropped by the worker)."""


class Refusal(StrEnum):
    TIER = "tier"
    TENANT = "tenant"
    RATE = "rate"


REFUSAL_CODES = {
    Refusal.TIER: ErrorCode.TIER_LIMIT_EXCEEDED,
    Refusal.TENANT: ErrorCode.TENANT_CONCURRENCY_EXCEEDED,
    Refusal.RATE: ErrorCode.TENANT_RATE_EXCEEDED,
}


@dataclass(frozen=True)
class Limits:
    """The limits one admission is checked against."""

    tier_max: int
    tenant_max: int
    rate_per_s: float
    burst: int


@dataclass(frozen=True)
class Verdict:
    refusal: Refusal | None
    retry_after_s: float = 0.0


def ledger_keys(job: JobPublic) -> list[str]:
    return [queue_ledger_key(job.queue), tenant_ledger_key(job.tenant)]


def admit_call(
    job: JobPublic,
    expires_at: float,
    limits: Limits,
    ttl_s: int,
    message: str | None = None,
    queue: str | None = None,
    routed: tuple[str, str] | None = None,
    stream: bool = False,
    reply_to: str | None = None,
    recalled: Recalled | None = None,
) -> tuple[list[str], list[str | int | float]]:
    """``(keys, args)`` of ``ADMIT`` for a new ``job`` (its record is written if admitted);
    ``expires_at`` is its deadline + ``LEDGER_GRACE_S``. ``message``, if given, is pushed
    in the same step onto ``queue`` (default: the job's pool queue). ``routed``: ``(worker
    id, message)`` of a job routed to that worker's own queue (``routed_key``). ``stream``:
    its caller streams, and its stream is opened (``STREAM_OPENED``). ``reply_to``: the reply
    channel (``reply_channel``) of the gateway whose caller waits for the job's end; its final
    record is published there. ``recalled``: the caller's access as the gateway last read it,
    not read for this request: admitted only if Redis still holds exactly that
    (``AccessChanged`` otherwise)."""
    if message is None:
        queue = NO_KEY
    elif queue is None:
        queue = job.queue
    index = routed_key(routed[0]) if routed else NO_KEY
    keys = [*ledger_keys(job), rate_key(job.tenant), job_key(job.id), DEADLINES, queue, index]
    keys.append(stream_key(job.id) if stream else NO_KEY)
    if recalled is not None:
        keys.append(recalled.key)
    args: list[str | int | float] = [
        job.id,
        repr(expires_at),
        limits.tier_max,
        limits.tenant_max,
        repr(limits.rate_per_s),
        limits.burst,
        job.status.value,
        job.model_dump_json(),
        ttl_s,
        repr(expires_at - LEDGER_GRACE_S),  # the deadline, for the sweeper's index
        message or "",
        routed[1] if routed else "",
        "1" if stream else "",
        reply_to or "",
    ]
    if recalled is not None:
        args += [*ACCESS_PREFIXES, recalled.name, *recalled.witness]
    return keys, args


def withdraw_call(job: JobPublic, burst: int) -> tuple[list[str], list[str | int | float]]:
    keys = [*ledger_keys(job), rate_key(job.tenant), job_key(job.id), DEADLINES]
    keys.append(stream_key(job.id))
    return keys, [job.id, burst, WITHDRAWN, WITHDRAWN_TTL_S]


class AccessChanged(Exception):
    """``ADMIT`` refused a recalled access: the key, its tenant, the grant or what the name
    resolves to is no longer what the gateway last read. Nothing was written; the gateway
    reads the access again and decides on that."""


class AdmissionWithdrawn(Exception):
    """An admission script found its job (or batch) already withdrawn: nothing was admitted.
    Only a copy of the script that outlived its caller can meet this."""


def verdict(reply: list[str]) -> Verdict:
    kind, retry = str(reply[0]), float(reply[1])
    if kind == "withdrawn":
        raise AdmissionWithdrawn
    if kind == "changed":
        raise AccessChanged
    return Verdict(None if kind == "admitted" else Refusal(kind), retry)


ADMIT_BATCH = (
    REFUSE_WHEN_FULL
    + TAKE_TOKEN_LUA
    + _WITHDRAWN_LUA
    + """
-- KEYS: 1 tenant ledger, 2 rate bucket, 3 batch hash, 4 batch lines, 5 deadline index,
-- 6..5+L the ledgers of the L pool queues the batch's jobs go to, then one job key per job,
-- the queue of each job's message (its pool queue, or the own queue of the worker it was
-- routed to), then each job's routed index (``routed_key``).
-- ARGV: 1 tenant max, 2 rate, 3 burst, 4 expiry, 5 ttl, 6 batch record, 7 batch webhook url,
-- 8 tenant, 9 total, 10 deadline (expiry - grace), 11 L, 12..11+L each ledger's maximum,
-- then per job: id, ledger index (0..L-1), record, line, queue message ('' if published
-- elsewhere), message kept for a routed job ('' if not routed).
-- Run again (a client retrying after its reply was lost): admitted already, and only once;
-- or withdrawn meanwhile (this copy waited in Redis's input after its caller gave up).
if redis.call('HEXISTS', KEYS[3], WITHDRAWN) == 1 then return {'withdrawn', '0'} end
if redis.call('EXISTS', KEYS[3]) == 1 then return {'admitted', '0'} end
local STRIDE = 6
local t = redis.call('TIME')
local now = tonumber(t[1]) + tonumber(t[2]) / 1e6
local L = tonumber(ARGV[11])
local total = tonumber(ARGV[9])
local JOBS = 6 + L       -- KEYS index of the first job key
local FIRST = 12 + L     -- ARGV index of the first job's fields
redis.call('ZREMRANGEBYSCORE', KEYS[1], '-inf', now)
local wanted = {}
for l = 1, L do wanted[l] = 0 end
for i = 0, total - 1 do
  local l = tonumber(ARGV[FIRST + i * STRIDE + 1]) + 1
  wanted[l] = wanted[l] + 1
end
for l = 1, L do
  if wanted[l] > 0 then
    redis.call('ZREMRANGEBYSCORE', KEYS[5 + l], '-inf', now)
    if redis.call('ZCARD', KEYS[5 + l]) + wanted[l] > tonumber(ARGV[11 + l]) then
      return {'tier', tostring(l - 1)}
    end
  end
end
if redis.call('ZCARD', KEYS[1]) + total > tonumber(ARGV[1]) then return {'tenant', '0'} end
local wait = take_token(KEYS[2], tonumber(ARGV[2]), tonumber(ARGV[3]), now)
if wait then return {'rate', tostring(wait)} end
for i = 0, total - 1 do
  local base = FIRST + i * STRIDE
  local id, l = ARGV[base], tonumber(ARGV[base + 1]) + 1
  redis.call('ZADD', KEYS[5 + l], ARGV[4], id)
  redis.call('ZADD', KEYS[1], ARGV[4], id)
  redis.call('ZADD', KEYS[5], ARGV[10], id)
  redis.call('HSET', KEYS[JOBS + i], 'status', 'queued', 'record', ARGV[base + 2], 'attempts', 0)
  if ARGV[base + 5] ~= '' then
    redis.call('HSET', KEYS[JOBS + i], 'message', ARGV[base + 5])
    local index = KEYS[JOBS + 2 * total + i]
    redis.call('ZREMRANGEBYSCORE', index, '-inf', now)
    redis.call('ZADD', index, ARGV[10], id)
  end
  redis.call('EXPIRE', KEYS[JOBS + i], ARGV[5])
  redis.call('RPUSH', KEYS[4], ARGV[base + 3])
  if ARGV[base + 4] ~= '' then redis.call('LPUSH', KEYS[JOBS + total + i], ARGV[base + 4]) end
end
redis.call('HSET', KEYS[3], 'record', ARGV[6], 'tenant', ARGV[8], 'total', total,
           'finished', 0, 'succeeded', 0, 'failed', 0, 'cancelled', 0)
if ARGV[7] ~= '' then redis.call('HSET', KEYS[3], 'webhook', ARGV[7]) end
redis.call('EXPIRE', KEYS[3], ARGV[5])
redis.call('EXPIRE', KEYS[4], ARGV[5])
return {'admitted', '0'}
"""
)
"""Admit every job of a batch or none: each pool queue's and the tenant's limit must hold them
all; the batch takes one token of the rate bucket (it is one request). When the queues
live in the same Redis, the jobs' messages are pushed in the same step, in order."""

WITHDRAW_BATCH = (
    _WITHDRAWN_LUA
    + """
-- KEYS: as ADMIT_BATCH's (up to the job keys). ARGV: 1 burst, 2 tombstone ttl (s), 3 L (pool
-- ledgers), 4.. job ids.
local admitted = redis.call('EXISTS', KEYS[3]) == 1
  and redis.call('HEXISTS', KEYS[3], WITHDRAWN) == 0
-- The batch's key becomes a tombstone, so that an ADMIT_BATCH still on its way is refused.
redis.call('DEL', KEYS[3])
redis.call('HSET', KEYS[3], WITHDRAWN, 1)
redis.call('EXPIRE', KEYS[3], ARGV[2])
if not admitted then return 0 end
local L = tonumber(ARGV[3])
for i = 4, #ARGV do
  redis.call('ZREM', KEYS[1], ARGV[i])
  for l = 1, L do redis.call('ZREM', KEYS[5 + l], ARGV[i]) end
  redis.call('ZREM', KEYS[5], ARGV[i])
  redis.call('DEL', KEYS[6 + L + i - 4])
end
redis.call('DEL', KEYS[4])
if redis.call('EXISTS', KEYS[2]) == 1 then
  local tokens = tonumber(redis.call('HGET', KEYS[2], 'tokens')) or 0
  redis.call('HSET', KEYS[2], 'tokens', tostring(math.min(tonumber(ARGV[1]), tokens + 1)))
end
return 1
"""
)
"""Undo a batch whose admission's reply was lost or whose enqueue failed: no records, no
ledger entries, no batch, token back, and the batch id closed to a late ``ADMIT_BATCH``.
Messages already published find no record and are dropped by the workers."""

TIER_ORDER: tuple[Tier, ...] = (Tier.HOT, Tier.WARM, Tier.COLD)


@dataclass(frozen=True)
class BatchLimits:
    tenant_max: int
    rate_per_s: float
    burst: int
    tier_max: dict[Tier, int]


def batch_queues(jobs: list[JobPublic]) -> list[str]:
    """The pool queues of a batch's jobs, each once, in the order they first appear: the
    ledgers ``ADMIT_BATCH`` checks and writes."""
    return list(dict.fromkeys(job.queue for job in jobs))


def _batch_keys(batch_id: str, tenant: str, jobs: list[JobPublic]) -> list[str]:
    return [
        tenant_ledger_key(tenant),
        rate_key(tenant),
        batch_key(batch_id),
        batch_jobs_key(batch_id),
        DEADLINES,
        *(queue_ledger_key(queue) for queue in batch_queues(jobs)),
        *(job_key(job.id) for job in jobs),
    ]


def admit_batch_call(
    batch: BatchRecord,
    jobs: list[JobPublic],
    lines: list[BatchLine],
    expires_at: float,
    limits: BatchLimits,
    ttl_s: int,
    messages: list[str] | None = None,
    queues: list[str] | None = None,
    routed: list[tuple[str, str] | None] | None = None,
) -> tuple[list[str], list[str | int | float]]:
    """``(keys, args)`` of ``ADMIT_BATCH``; ``messages`` (one per job, in order), if given,
    are pushed in the same step onto ``queues`` (one per job; default: each job's pool
    queue). ``routed``: per job, ``(worker id, message)`` if routed to that worker's own
    queue (``admit_call``). Each pool queue holds at most its tier's ``limits.tier_max``."""
    ledgers = batch_queues(jobs)
    tier_of = {job.queue: job.tier for job in jobs}
    args: list[str | int | float] = [
        limits.tenant_max,
        repr(limits.rate_per_s),
        limits.burst,
        repr(expires_at),
        ttl_s,
        batch.model_dump_json(),
        batch.webhook.url if batch.webhook else "",
        batch.tenant,
        len(jobs),
        repr(expires_at - LEDGER_GRACE_S),
        len(ledgers),
        *(limits.tier_max[tier_of[queue]] for queue in ledgers),
    ]
    pushed: list[str] = [""] * len(jobs) if messages is None else messages
    kept = routed if routed is not None else [None] * len(jobs)
    for job, line, message, route in zip(jobs, lines, pushed, kept, strict=True):
        args += [
            job.id,
            ledgers.index(job.queue),
            job.model_dump_json(),
            line.model_dump_json(),
            message,
            route[1] if route else "",
        ]
    keys = _batch_keys(batch.id, batch.tenant, jobs)
    keys += queues if queues is not None else [job.queue for job in jobs]
    keys += [routed_key(route[0]) if route else NO_KEY for route in kept]
    return keys, args


def withdraw_batch_call(
    batch: BatchRecord, jobs: list[JobPublic], burst: int
) -> tuple[list[str], list[str | int | float]]:
    ledgers = len(batch_queues(jobs))
    args: list[str | int | float] = [burst, WITHDRAWN_TTL_S, ledgers, *(job.id for job in jobs)]
    return _batch_keys(batch.id, batch.tenant, jobs), args


def batch_verdict(reply: list[str], jobs: list[JobPublic]) -> tuple[Verdict, str | None]:
    """The verdict, and for a tier refusal the pool queue that had no room."""
    kind = str(reply[0])
    if kind == "tier":
        return Verdict(Refusal.TIER), batch_queues(jobs)[int(reply[1])]
    return verdict(reply), None
