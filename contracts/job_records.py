"""How job records change in Redis: one Lua script, used by the gateway and the worker alike.

A record is a hash ``{status, record (JobPublic JSON), attempts}`` under ``job_key(id)``,
with ``started_at`` and ``worker`` beside them while an attempt runs (``job_of`` reads them
together), ``message`` while a job routed to one worker waits for it (``routed_key``), and
``reply``, the reply channel of the gateway whose caller waits for the job's end. Every
change but a claim goes through ``ADVANCE``, a compare-and-set that

- never moves a job out of a terminal state (succeeded, failed, cancelled), so a redelivered
  or late attempt can't overwrite the outcome, and the first terminal write is the only one;
- never resurrects a record that expired or was never created;
- optionally requires the ``attempts`` counter to still hold the value the writer read, so two
  writers racing on one job (a gateway cancelling it, a worker claiming it) can't both win;
- drops the job's lease (``lease_key``) whenever the job stops running (queued again, or
  terminal), so the next delivery may claim it;
- when the job becomes terminal, and only then: removes it from the admission ledgers
  (``contracts.admission``) and from the deadline index; creates its webhook event and
  schedules its first delivery attempt, if it has a webhook; counts it in its batch, and
  creates the batch's webhook event when it is the batch's last job; appends the end marker
  (``STREAM_END``, with the record) to its stream if it has one (streaming readers end at
  once, and need not read the record); publishes the record on the reply channel its
  admission named, if any (``reply``: the gateway whose caller waits for it, which then need
  not read it: ``reply_job``), then its id on ``JOB_EVENTS`` (waiters wake), and on
  ``JOB_CANCELS`` when it becomes cancelled (the worker running it aborts it). So every
  effect of a job's outcome happens exactly once, however often the job is delivered.

A worker starts an attempt with ``CLAIM`` (which counts the attempt and writes only the
fields beside the record, refused while another attempt holds the job's lease) and keeps its
lease alive with ``RENEW``;
streamed text is appended with ``APPEND_DELTAS``, refused to an attempt that no longer holds
the lease. So two attempts of one job never generate at once, and a stale one can neither
write an outcome (its ``attempts`` is not the counter's) nor interleave its text.
"""

from __future__ import annotations

from collections.abc import Sequence
from datetime import datetime
from enum import IntEnum, StrEnum
from typing import Any

from contracts.jobs import TERMINAL_STATUSES, JobPublic, JobStatus
from contracts.keys import (
    DEADLINES,
    JOB_CANCELS,
    JOB_EVENTS,
    NO_KEY,
    STREAM_END,
    WEBHOOKS_DUE,
    batch_key,
    held_key,
    job_key,
    lease_key,
    queue_ledger_key,
    routed_key,
    stream_key,
    tenant_ledger_key,
    webhook_event_key,
)
from contracts.webhooks import batch_event_id, job_event_id

CREATE_EVENT_LUA = """
local function create_event(ekey, due, evt, url, tenant, kind, subject, ttl, now)
  if redis.call('EXISTS', ekey) == 1 then return end
  redis.call('HSET', ekey, 'url', url, 'tenant', tenant, 'kind', kind, 'subject', subject,
             'state', 'pending', 'attempts', 0, 'created_at', now)
  redis.call('EXPIRE', ekey, ttl)
  redis.call('ZADD', due, now, evt)
end
"""
"""Lua: create a webhook event once and make it due now (used on terminal transitions)."""

_TERMINAL_LUA = " or ".join(f"s == '{status.value}'" for status in sorted(TERMINAL_STATUSES))

REPLY_MAX_BYTES = 65536
"""The largest record ``ADVANCE`` publishes on a reply channel; a larger one is read back (a
result over the workers' ``result_offload_bytes``, 16 KiB by default, is kept in the object
store and its record holds only a reference, so records past this are rare unless that is set
to 0 or above this)."""

WITHDRAWN = "withdrawn"
"""The ``status`` of a job key whose admission was withdrawn (``contracts.admission``
``WITHDRAW``): no record, and no script admits, claims or writes it again."""

WITHDRAWN_TTL_S = 600
"""How long a withdrawn job's key stays: longer than an admission script sent before the
withdrawal can wait in Redis's input (a reply lost to a timeout, the connection closed)."""

ADVANCE = (
    CREATE_EVENT_LUA
    + f"""
local function terminal(s) return {_TERMINAL_LUA} end
local status = redis.call('HGET', KEYS[1], 'status')
if not status or status == '{WITHDRAWN}' then return -1 end
if status == ARGV[1] then
  -- This very write, sent again (its reply was lost): it was written, by this call.
  local now = redis.call('HMGET', KEYS[1], 'record', 'attempts')
  if now[1] == ARGV[2] and now[2] == ARGV[5] then return 1 end
end
if terminal(status) then return 0 end
if ARGV[4] ~= '' and (redis.call('HGET', KEYS[1], 'attempts') or '0') ~= ARGV[4] then
  return -2
end
redis.call('HSET', KEYS[1], 'status', ARGV[1], 'record', ARGV[2])
-- The record says it all now (and a kept message is no longer needed: ``routed_key``).
redis.call('HDEL', KEYS[1], 'started_at', 'worker', 'message')
if ARGV[5] ~= '' then redis.call('HSET', KEYS[1], 'attempts', ARGV[5]) end
redis.call('EXPIRE', KEYS[1], ARGV[3])
if ARGV[1] ~= '{JobStatus.RUNNING.value}' then redis.call('DEL', KEYS[10]) end
if terminal(ARGV[1]) then
  redis.call('ZREM', KEYS[4], ARGV[6])
  redis.call('ZREM', KEYS[5], ARGV[6])
  redis.call('ZREM', KEYS[11], ARGV[6])
  local t = redis.call('TIME')
  local now = tonumber(t[1]) + tonumber(t[2]) / 1e6
  if ARGV[7] ~= '' then
    create_event(KEYS[6], KEYS[7], ARGV[9], ARGV[7], ARGV[8], 'job', ARGV[6], ARGV[3], now)
  end
  if ARGV[10] ~= '' and redis.call('EXISTS', KEYS[8]) == 1 then
    local finished = redis.call('HINCRBY', KEYS[8], 'finished', 1)
    redis.call('HINCRBY', KEYS[8], ARGV[1], 1)
    if finished == tonumber(redis.call('HGET', KEYS[8], 'total')) then
      redis.call('HSET', KEYS[8], 'completed_at', now)
      local url = redis.call('HGET', KEYS[8], 'webhook')
      if url then
        create_event(KEYS[9], KEYS[7], ARGV[11], url, ARGV[8], 'batch', ARGV[10], ARGV[3], now)
      end
    end
  end
  local kept = redis.call('HMGET', KEYS[1], 'attempts', 'reply')
  local attempts, reply = kept[1] or '0', kept[2]
  if redis.call('EXISTS', KEYS[12]) == 1 then
    redis.call('XADD', KEYS[12], '*', '{STREAM_END}', ARGV[1], 'record', ARGV[2],
               'attempts', attempts)
  end
  -- Before the id on ``JOB_EVENTS``: the gateway that waits has the record when it wakes.
  if reply and #ARGV[2] <= {REPLY_MAX_BYTES} then
    local nl = '\\n'
    redis.call('PUBLISH', reply, ARGV[6] .. nl .. attempts .. nl .. ARGV[1] .. nl .. ARGV[2])
  end
  redis.call('PUBLISH', KEYS[2], ARGV[6])
end
if ARGV[1] == '{JobStatus.CANCELLED.value}' then redis.call('PUBLISH', KEYS[3], ARGV[6]) end
return 1
"""
)


CLAIM = f"""
local function terminal(s) return {_TERMINAL_LUA} end
-- KEYS: 1 job, 2 lease, 3 the worker's held deliveries, 4 the routed index of the worker
-- the job was routed to. ARGV: 1 worker id, 2 lease ttl (ms), 3 record ttl (s), 4 max
-- attempts, 5 started at (ISO 8601), 6 '1' to leave a running job without a lease alone
-- (rejoining), 7 the delivery's tag ('': none), 8 the job id.
-- Returns {{outcome}} and, unless missing, the job's RECORD_FIELDS as they are now.
if ARGV[7] ~= '' then redis.call('HSET', KEYS[3], ARGV[7], ARGV[8]) end
-- A worker has the message: it is held or in the broker's unacknowledged set from here on.
redis.call('ZREM', KEYS[4], ARGV[8])
local status = redis.call('HGET', KEYS[1], 'status')
if not status or status == '{WITHDRAWN}' then return {{'missing'}} end
local fields = redis.call('HMGET', KEYS[1], 'record', 'attempts', 'started_at', 'worker')
local record, attempts = fields[1], tonumber(fields[2] or '0')
-- As it stands (job_of's fields), for the caller to write from if it may not run.
local current = {{record, status, attempts, fields[3], fields[4]}}
-- This very call, sent again (its reply was lost to a timeout or a dropped connection): it
-- ran, so it answers as it did. Its start time and worker are unique to the call.
if status == '{JobStatus.RUNNING.value}' and fields[3] == ARGV[5] and fields[4] == ARGV[1]
  and redis.call('GET', KEYS[2]) == ARGV[1] .. '|' .. attempts then
  return {{'run', unpack(current)}}
end
if terminal(status) then return {{'finished', unpack(current)}} end
if redis.call('EXISTS', KEYS[2]) == 1 then return {{'leased', unpack(current)}} end
if status == '{JobStatus.RUNNING.value}' and ARGV[6] == '1' then
  return {{'rejoining', unpack(current)}}
end
local failures = cjson.decode(record)['engine_failures']
local most = tonumber(ARGV[4])
if attempts >= most or (type(failures) == 'number' and failures >= most) then
  return {{'exhausted', unpack(current)}}
end
attempts = attempts + 1
redis.call('HSET', KEYS[1], 'status', '{JobStatus.RUNNING.value}', 'attempts', attempts,
           'started_at', ARGV[5], 'worker', ARGV[1])
redis.call('HDEL', KEYS[1], 'message')
redis.call('EXPIRE', KEYS[1], ARGV[3])
-- The lease value is ``lease_value(worker id, attempt)``.
redis.call('SET', KEYS[2], ARGV[1] .. '|' .. attempts, 'PX', ARGV[2])
return {{'run', record, '{JobStatus.RUNNING.value}', attempts, ARGV[5], ARGV[1]}}
"""
"""Start an attempt, in one round trip: unless the job is finished, another attempt holds
its lease, or it may not start again (``exhausted``: too many attempts or engine deaths
under it), it becomes ``running`` with the attempt counted and claimed (``started_at``,
``worker``: hash fields beside the record, see ``job_of``) and the lease is taken. The
record is returned in every case, so the caller needs no read of its own. The delivery is
recorded among the worker's held ones first (``held_key``): whatever the claim decides, a
worker that dies from here on has it handed back by a reaper."""


class Claimed(StrEnum):
    """What ``CLAIM`` did."""

    RUN = "run"
    FINISHED = "finished"
    MISSING = "missing"
    LEASED = "leased"
    REJOINING = "rejoining"
    EXHAUSTED = "exhausted"


RECORD_FIELDS = ("record", "status", "attempts", "started_at", "worker")
"""The fields of a job's hash that make up the job as callers see it (``job_of``)."""


def job_of(values: Sequence[Any]) -> JobPublic | None:
    """The job a hash's ``RECORD_FIELDS`` (in order) describe: the record last written, under
    the status and attempt count the scripts keep beside it and, while an attempt runs, its
    claim (``CLAIM`` writes only those, not the record). ``None`` if there is no record."""
    record, status, attempts, started_at, worker = values
    if record is None:
        return None
    job = JobPublic.model_validate_json(record)
    update: dict[str, object] = {}
    if status is not None and status != job.status.value:
        update["status"] = JobStatus(status)
    if attempts is not None and int(attempts) != job.attempts:
        update["attempts"] = int(attempts)
    if started_at is not None:
        update["started_at"] = datetime.fromisoformat(started_at)
        update["worker"] = worker
    return job.model_copy(update=update) if update else job


def reply_id(reply: str) -> str:
    """The job id a reply channel's message is about: its first line (``reply_job``)."""
    return reply.partition("\n")[0]


def reply_job(reply: str) -> JobPublic:
    """The final record a reply channel's message holds, as ``ADVANCE`` publishes it: the
    job's id, ``attempts``, ``status`` and the record, one per line (the record's JSON holds
    no newline)."""
    _, attempts, status, record = reply.split("\n", 3)
    job = job_of((record, status, attempts, None, None))
    assert job is not None  # a record was given
    return job


HOLDS_LUA = f"""
local function holds(lease, job, value, ttl)
  local holder = redis.call('GET', lease)
  if holder == value then return true end
  if holder then return false end
  -- Expired while Redis was away (or restarted): if the record says this attempt still runs
  -- the job and nobody claimed it since, the lease is taken back.
  local attempt = string.match(value, '|(%d+)$')
  if redis.call('HGET', job, 'status') == '{JobStatus.RUNNING.value}'
      and redis.call('HGET', job, 'attempts') == attempt then
    redis.call('SET', lease, value, 'PX', ttl)
    return true
  end
  return false
end
"""
"""Lua: does the attempt named by ``value`` (``worker|attempt``) hold the job's lease?"""

RENEW = (
    HOLDS_LUA
    + """
-- KEYS: per attempt, its lease and its job record. ARGV: 1 lease ttl (ms), then per attempt
-- its lease value. Returns the 1-based positions of the attempts that lost their lease.
local lost = {}
for i = 1, #KEYS / 2 do
  local lease, job, value = KEYS[2 * i - 1], KEYS[2 * i], ARGV[i + 1]
  if holds(lease, job, value, ARGV[1]) then
    redis.call('PEXPIRE', lease, ARGV[1])
  else
    table.insert(lost, i)
  end
end
return lost
"""
)
"""Keep the leases of the attempts a worker runs; report those it no longer holds."""

APPEND_DELTAS = (
    HOLDS_LUA
    + """
-- KEYS: per job, its stream, its lease and its record. ARGV: 1 stream ttl (s), 2 lease ttl
-- (ms), then per job the lease value, the byte offset of the text in the execution's text,
-- and the text. Entries are tagged with the lease value (it names one execution) and their
-- offset. A text the stream already holds in part (a call that ran but whose reply was lost,
-- sent again with what came since) is appended from where the execution's last entry ends:
-- nothing twice. Returns the 1-based positions refused.
local refused = {}
for i = 1, #KEYS / 3 do
  local stream, lease, job = KEYS[3 * i - 2], KEYS[3 * i - 1], KEYS[3 * i]
  local value, off, text = ARGV[3 * i], tonumber(ARGV[3 * i + 1]), ARGV[3 * i + 2]
  if holds(lease, job, value, ARGV[2]) then
    local skip = 0
    local last = redis.call('XREVRANGE', stream, '+', '-', 'COUNT', 1)[1]
    if last then
      local f, attempt, at, written = last[2], nil, nil, nil
      for j = 1, #f, 2 do
        if f[j] == 'attempt' then attempt = f[j + 1]
        elseif f[j] == 'off' then at = tonumber(f[j + 1])
        elseif f[j] == 'text' then written = f[j + 1] end
      end
      if attempt == value and at and written and at + #written > off then
        skip = at + #written - off
      end
    end
    if skip < #text then
      redis.call('XADD', stream, '*', 'attempt', value, 'off', off + skip,
                 'text', string.sub(text, skip + 1))
    end
    redis.call('EXPIRE', stream, ARGV[1])
  else
    table.insert(refused, i)
  end
end
return refused
"""
)
"""Append streamed text for attempts that still hold their job's lease."""


class Advance(IntEnum):
    """What ``ADVANCE`` did."""

    WRITTEN = 1
    ALREADY_FINISHED = 0
    MISSING = -1
    CONFLICT = -2


def lease_value(worker_id: str, attempt: int) -> str:
    """The lease of ``attempt`` run by ``worker_id``."""
    return f"{worker_id}|{attempt}"


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
        queue_ledger_key(job.queue),
        tenant_ledger_key(job.tenant),
        webhook_event_key(job_event_id(job.id)) if job.webhook else NO_KEY,
        WEBHOOKS_DUE,
        batch_key(job.batch) if job.batch else NO_KEY,
        webhook_event_key(batch_event_id(job.batch)) if job.batch else NO_KEY,
        lease_key(job.id),
        DEADLINES,
        stream_key(job.id),
    ]
    args: list[str | int] = [
        job.status.value,
        job.model_dump_json(),
        ttl_s,
        "" if expect_attempts is None else str(expect_attempts),
        str(job.attempts),
        job.id,
        job.webhook.url if job.webhook else "",
        job.tenant,
        job_event_id(job.id),
        job.batch or "",
        batch_event_id(job.batch) if job.batch else "",
    ]
    return keys, args


def claim_call(
    job_id: str,
    worker_id: str,
    started_at: datetime,
    max_attempts: int,
    rejoining: bool,
    lease_ttl_s: float,
    ttl_s: int,
    delivery: str = "",
    routed_to: str | None = None,
) -> tuple[list[str], list[str | int]]:
    """``(keys, args)`` of ``CLAIM``: ``worker_id`` starts an attempt of ``job_id`` at
    ``started_at``, unless ``max_attempts`` were started (or engines died under it as often);
    ``rejoining`` leaves a running job without a lease to the attempt that may take it back.
    ``delivery`` is the broker's tag of the message being run (recorded as held);
    ``routed_to``, the worker the job was routed to (``routed_key``)."""
    keys = [
        job_key(job_id),
        lease_key(job_id),
        held_key(worker_id) if delivery else NO_KEY,
        routed_key(routed_to) if routed_to else NO_KEY,
    ]
    args: list[str | int] = [
        worker_id,
        _ms(lease_ttl_s),
        ttl_s,
        max_attempts,
        started_at.isoformat(),
        "1" if rejoining else "",
        delivery,
        job_id,
    ]
    return keys, args


def _ms(seconds: float) -> int:
    return max(1, round(seconds * 1000))


def renew_call(
    leases: list[tuple[str, str]], lease_ttl_s: float
) -> tuple[list[str], list[str | int]]:
    """``(keys, args)`` of ``RENEW`` for ``(job id, lease value)`` pairs."""
    keys: list[str] = []
    args: list[str | int] = [_ms(lease_ttl_s)]
    for job_id, lease in leases:
        keys += [lease_key(job_id), job_key(job_id)]
        args.append(lease)
    return keys, args


def append_call(
    deltas: list[tuple[str, str, int, str]], stream_ttl_s: int, lease_ttl_s: float
) -> tuple[list[str], list[str | int]]:
    """``(keys, args)`` of ``APPEND_DELTAS`` for ``(job id, lease value, offset, text)``:
    ``offset`` is where ``text`` starts in the execution's text, in UTF-8 bytes."""
    keys: list[str] = []
    args: list[str | int] = [stream_ttl_s, _ms(lease_ttl_s)]
    for job_id, lease, offset, text in deltas:
        keys += [stream_key(job_id), lease_key(job_id), job_key(job_id)]
        args += [lease, offset, text]
    return keys, args
