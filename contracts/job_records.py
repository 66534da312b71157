"""How job records change in Redis: one Lua script, used by the gateway and the worker alike.

A record is a hash ``{status, record (JobPublic JSON), attempts}`` under ``job_key(id)``.
Every change goes through ``ADVANCE``, a compare-and-set that

- never moves a job out of a terminal state (succeeded, failed, cancelled), so a redelivered
  or late attempt can't overwrite the outcome, and the first terminal write is the only one;
- never resurrects a record that expired or was never created;
- optionally requires the ``attempts`` counter to still hold the value the writer read, so two
  writers racing on one job (a gateway cancelling it, a worker claiming it) can't both win;
- when the job becomes terminal, and only then, removes it from the admission ledgers
  (``contracts.admission``) and publishes its id on ``JOB_EVENTS`` (waiters wake); on
  ``JOB_CANCELS`` too when it becomes cancelled (the worker running it aborts it).
"""

from __future__ import annotations

from enum import IntEnum

from contracts.jobs import TERMINAL_STATUSES, JobPublic, JobStatus
from contracts.keys import JOB_CANCELS, JOB_EVENTS, job_key, tenant_ledger_key, tier_ledger_key

_TERMINAL_LUA = " or ".join(f"s == '{status.value}'" for status in sorted(TERMINAL_STATUSES))

ADVANCE = f"""
local function terminal(s) return {_TERMINAL_LUA} end
local status = redis.call('HGET', KEYS[1], 'status')
if not status then return -1 end
if terminal(status) then return 0 end
if ARGV[4] ~= '' and (redis.call('HGET', KEYS[1], 'attempts') or '0') ~= ARGV[4] then
  return -2
end
redis.call('HSET', KEYS[1], 'status', ARGV[1], 'record', ARGV[2])
if ARGV[5] ~= '' then redis.call('HSET', KEYS[1], 'attempts', ARGV[5]) end
redis.call('EXPIRE', KEYS[1], ARGV[3])
if terminal(ARGV[1]) then
  redis.call('ZREM', KEYS[4], ARGV[6])
  redis.call('ZREM', KEYS[5], ARGV[6])
  redis.call('PUBLISH', KEYS[2], ARGV[6])
end
if ARGV[1] == '{JobStatus.CANCELLED.value}' then redis.call('PUBLISH', KEYS[3], ARGV[6]) end
return 1
"""


class Advance(IntEnum):
    """What ``ADVANCE`` did."""

    WRITTEN = 1
    ALREADY_FINISHED = 0
    MISSING = -1
    CONFLICT = -2


def advance_call(
    job: JobPublic, ttl_s: int, expect_attempts: int | None = None
) -> tuple[list[str], list[str | int]]:
    """``(keys, args)`` writing ``job`` as the record; ``job.attempts`` is stored with it.

    With ``expect_attempts``, the write only happens if the stored counter still equals it.
    """
    keys = [
        job_key(job.id),
        JOB_EVENTS,
        JOB_CANCELS,
        tier_ledger_key(job.tier.value),
        tenant_ledger_key(job.tenant),
    ]
    args: list[str | int] = [
        job.status.value,
        job.model_dump_json(),
        ttl_s,
        "" if expect_attempts is None else str(expect_attempts),
        str(job.attempts),
        job.id,
    ]
    return keys, args
