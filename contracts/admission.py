"""Admission ledger: how many jobs are admitted and unfinished, per tier and per tenant.

Each ledger is a sorted set ``job id -> expiry`` (unix seconds). Admission (``ADMIT``) checks
every limit and, only if all pass, records the job in both ledgers, takes a token from the
tenant's rate bucket and writes the job record: one script, so 50 concurrent submissions
against a limit of 20 admit exactly 20. The job leaves both ledgers when it reaches a
terminal state (``contracts.job_records.ADVANCE`` removes it in the same script that writes
the outcome, so the release happens once however often the job is delivered). A sorted set,
not a counter: removing a job twice is harmless, a count can't go negative, and an entry whose
job can no longer finish (its record expired, no worker ever came) drops out at its expiry,
``deadline + LEDGER_GRACE_S``, instead of holding a slot forever.
"""

from __future__ import annotations

from dataclasses import dataclass
from enum import StrEnum

from contracts.errors import ErrorCode
from contracts.jobs import JobPublic
from contracts.keys import job_key, rate_key, tenant_ledger_key, tier_ledger_key

LEDGER_GRACE_S = 60.0
"""A job still unfinished this long after its deadline no longer counts against limits."""

ADMIT = """
local now_t = redis.call('TIME')
local now = tonumber(now_t[1]) + tonumber(now_t[2]) / 1e6
redis.call('ZREMRANGEBYSCORE', KEYS[1], '-inf', now)
redis.call('ZREMRANGEBYSCORE', KEYS[2], '-inf', now)
if redis.call('ZCARD', KEYS[1]) >= tonumber(ARGV[3]) then return {'tier', '0'} end
if redis.call('ZCARD', KEYS[2]) >= tonumber(ARGV[4]) then return {'tenant', '0'} end
local rate, burst = tonumber(ARGV[5]), tonumber(ARGV[6])
local bucket = redis.call('HMGET', KEYS[3], 'tokens', 'at')
local tokens = tonumber(bucket[1]) or burst
local at = tonumber(bucket[2]) or now
tokens = math.min(burst, tokens + math.max(0, now - at) * rate)
if tokens < 1 then return {'rate', tostring((1 - tokens) / rate)} end
redis.call('HSET', KEYS[3], 'tokens', tostring(tokens - 1), 'at', tostring(now))
redis.call('EXPIRE', KEYS[3], math.ceil(burst / rate) + 1)
redis.call('ZADD', KEYS[1], ARGV[2], ARGV[1])
redis.call('ZADD', KEYS[2], ARGV[2], ARGV[1])
redis.call('HSET', KEYS[4], 'status', ARGV[7], 'record', ARGV[8], 'attempts', 0)
redis.call('EXPIRE', KEYS[4], ARGV[9])
return {'admitted', '0'}
"""

WITHDRAW = """
redis.call('DEL', KEYS[4])
local removed = redis.call('ZREM', KEYS[1], ARGV[1])
redis.call('ZREM', KEYS[2], ARGV[1])
if removed == 1 and redis.call('EXISTS', KEYS[3]) == 1 then
  local tokens = tonumber(redis.call('HGET', KEYS[3], 'tokens')) or 0
  redis.call('HSET', KEYS[3], 'tokens', tostring(math.min(tonumber(ARGV[2]), tokens + 1)))
end
return removed
"""
"""Undo an admission whose enqueue failed: no record, no ledger entry, the token refunded."""


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
    return [tier_ledger_key(job.tier.value), tenant_ledger_key(job.tenant)]


def admit_call(
    job: JobPublic, expires_at: float, limits: Limits, ttl_s: int
) -> tuple[list[str], list[str | int | float]]:
    """``(keys, args)`` of ``ADMIT`` for a new ``job`` (its record is written if admitted)."""
    keys = [*ledger_keys(job), rate_key(job.tenant), job_key(job.id)]
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
    ]
    return keys, args


def withdraw_call(job: JobPublic, burst: int) -> tuple[list[str], list[str | int | float]]:
    keys = [*ledger_keys(job), rate_key(job.tenant), job_key(job.id)]
    return keys, [job.id, burst]


def verdict(reply: list[str]) -> Verdict:
    kind, retry = str(reply[0]), float(reply[1])
    return Verdict(None if kind == "admitted" else Refusal(kind), retry)
