"""Where a job goes: the routing policy, in one place (pure; the gateway applies it at admission).

Workers publish what they hold, per adapter digest and level, and their load (their
announcement, ``worker.runtime``: at least every second, and soon after a change). Each
gateway keeps the fleet's announcements in memory (``gateway.routing``, refreshed every
``LORAFLEET_ROUTE_REFRESH_S``), so routing costs an admission no Redis round trip: the
admission script pushes the job's message onto the queue chosen here instead of the pool's.

For a job of adapter ``D`` (base model ``B``, tier ``T``), the *pool* is the serving workers of
``B`` that take ``T``: the consumers of the pool queue ``lorafleet.<T>.<pool id of B>``
(``contracts.queues``), which only workers serving ``B`` take from. A worker is *overloaded*
when its outstanding jobs (running, waiting in its own queue, and routed to it by this
gateway since the last refresh) reach ``LORAFLEET_ROUTE_OVERLOAD_RATIO`` x its concurrency. Then:

1. **resident**: a worker of the pool that holds ``D`` (pinned > registered in the engine >
   on disk), not overloaded, least loaded among those of the best level: its own queue.
2. **placed**: if fewer than ``LORAFLEET_ROUTE_MAX_COPIES`` workers hold ``D`` (none, for a
   first miss), of the two workers of the pool, not overloaded, that rank first for ``D`` by
   rendezvous hashing (highest ``hash(D, worker)``), the less busy (jobs per concurrency
   plus adapters in the engine per GPU slot): gateways with the same view pick the same one,
   so concurrent first misses for an adapter make one copy (two at most), not one per
   worker, and a worker joining or leaving moves only adapters it ranks high for. A worker
   this gateway placed ``D`` on is a copy from then on, before its announcement shows ``D``
   (its fetch takes seconds): it takes ``D``'s next jobs while it is not overloaded (also
   ``placed``), and it counts against the cap, so announcements that lag never let this
   gateway place a copy past it (each gateway knows only its own placements).
3. **shared**: otherwise (every holder overloaded and the copies at the cap, nobody to place
   on, no fresh view of the fleet, or a pool of one worker that the pool queue reaches
   alone): the pool queue, which every worker of the pool takes from.

A copy is a worker holding ``D`` at any level, disk included: a copy on disk costs no S3 GET to
load. The cap bounds copies made by routing; a job from the shared queue may still make one
more (load shedding beats waiting). Routing never decides what runs: the worker checks the
adapter's identity as always, and a routed job that waits too long, or whose worker stops,
goes back to the shared queue (``HANDBACK``).

Designed after llm-d's inference scheduler (a scorer per signal, prefix-cache affinity
weighed against queue depth and KV-cache use, filters before scorers) and Ray Serve's model
multiplexing (requests go to a replica that already has the model loaded, else to the
least loaded one, which loads it); the copy cap and the rendezvous placement are what a LoRA
fleet adds: an adapter's S3 GETs and engine loads are bounded per adapter, not per worker.
"""

from __future__ import annotations

import hashlib
import math
from collections.abc import Collection, Mapping, Sequence
from dataclasses import dataclass, field
from enum import IntEnum, StrEnum

from contracts.queues import QUEUE_PREFIX


class Level(IntEnum):
    """How close an adapter is to running on a worker; higher is closer."""

    DISK = 1
    ENGINE = 2
    PINNED = 3


LEVELS_BY_NAME = {"disk": Level.DISK, "engine": Level.ENGINE, "pinned": Level.PINNED}
"""The levels as workers announce them."""


class Decision(StrEnum):
    RESIDENT = "resident"
    PLACED = "placed"
    SHARED = "shared"


WORKER_QUEUE_PREFIX = f"{QUEUE_PREFIX}worker."


def worker_queue(worker_id: str) -> str:
    """The queue (a Redis list of that name) of one worker's routed jobs."""
    return f"{WORKER_QUEUE_PREFIX}{worker_id}"


@dataclass(frozen=True)
class Policy:
    max_copies: int
    overload_ratio: float


@dataclass(frozen=True)
class WorkerState:
    """One serving worker as the gateway last saw it."""

    worker_id: str
    base_model: str
    """Digest of the base model it serves."""
    queues: frozenset[str]
    """Pool queues it takes from (``contracts.queues.queue_for``)."""
    concurrency: int
    outstanding: int
    """Jobs running on it plus jobs waiting in its own queue."""
    adapters: Mapping[str, Level] = field(default_factory=dict)
    """Adapter digest -> the best level it holds it at."""
    slots: int = 1
    """GPU adapter slots (``max_loras``)."""


@dataclass(frozen=True)
class Route:
    decision: Decision
    worker: WorkerState | None = None

    @property
    def worker_id(self) -> str | None:
        return None if self.worker is None else self.worker.worker_id


SHARED = Route(Decision.SHARED)


def rendezvous_score(digest: str, worker_id: str) -> int:
    """Highest random weight of ``worker_id`` for ``digest`` (same on every gateway)."""
    seed = f"{digest}|{worker_id}".encode()
    return int.from_bytes(hashlib.blake2b(seed, digest_size=8).digest(), "big")


def overloaded(worker: WorkerState, extra: int, policy: Policy) -> bool:
    bound = max(1, math.ceil(worker.concurrency * policy.overload_ratio))
    return worker.outstanding + extra >= bound


def choose(
    workers: Sequence[WorkerState],
    base_model: str,
    pool_queue: str,
    digest: str,
    policy: Policy,
    routed_since: Mapping[str, int] | None = None,
    placing: Collection[str] = (),
) -> Route:
    """Where a job of ``digest`` (base model ``base_model``, pool queue ``pool_queue``) goes.
    ``routed_since``: jobs this gateway routed to each worker since ``workers`` was read.
    ``placing``: workers this gateway placed ``digest`` on whose announcements do not show it
    yet (its fetch takes a while): copies being made, which count against the cap and take
    the adapter's next jobs before another copy is placed."""
    extra = routed_since or {}
    pool = [w for w in workers if pool_queue in w.queues and w.base_model == base_model]
    if len(pool) <= 1:
        return SHARED  # nobody to route to, or the pool queue reaches its only worker

    def free(worker: WorkerState) -> bool:
        return not overloaded(worker, extra.get(worker.worker_id, 0), policy)

    def load(worker: WorkerState) -> float:
        return (worker.outstanding + extra.get(worker.worker_id, 0)) / max(1, worker.concurrency)

    holders = [w for w in pool if digest in w.adapters]
    coming = [w for w in pool if digest not in w.adapters and w.worker_id in placing]
    ready = [w for w in holders if free(w)]
    if ready:
        best = min(
            ready,
            key=lambda w: (-w.adapters[digest], load(w), -rendezvous_score(digest, w.worker_id)),
        )
        return Route(Decision.RESIDENT, best)
    arriving = [w for w in coming if free(w)]
    if arriving:
        best = min(arriving, key=lambda w: (load(w), -rendezvous_score(digest, w.worker_id)))
        return Route(Decision.PLACED, best)
    # Copies being made count wherever they are: a placed worker missing from this view
    # (its announcement late) is fetching the adapter all the same.
    shown = {w.worker_id for w in pool}
    elsewhere = sum(1 for worker_id in placing if worker_id not in shown)
    if len(holders) + len(coming) + elsewhere < policy.max_copies:
        others = [w for w in pool if digest not in w.adapters and w not in coming and free(w)]
        if others:
            # The first two by rendezvous rank, the less busy of them (ties: the first): two
            # choices bound how many adapters pile onto one worker far better than one, and
            # concurrent first misses still land on at most two workers (within the cap).
            ranked = sorted(others, key=lambda w: -rendezvous_score(digest, w.worker_id))[:2]
            chosen = min(ranked, key=lambda w: _busy(w, extra.get(w.worker_id, 0)))
            return Route(Decision.PLACED, chosen)
    return SHARED


def _busy(worker: WorkerState, extra: int) -> float:
    """Jobs per unit of concurrency plus adapters in the engine per GPU adapter slot: what a
    new adapter competes with there."""
    in_engine = sum(1 for level in worker.adapters.values() if level >= Level.ENGINE)
    return (worker.outstanding + extra) / max(1, worker.concurrency) + in_engine / max(
        1, worker.slots
    )


def copies(workers: Sequence[WorkerState]) -> dict[str, int]:
    """Adapter digest -> how many workers hold it (any level)."""
    counts: dict[str, int] = {}
    for worker in workers:
        for digest in worker.adapters:
            counts[digest] = counts.get(digest, 0) + 1
    return counts


_TARGET_LUA = """
-- The shared queue a job message goes back to: the one its envelope names (its pool queue,
-- where kombu restores it too), or ``fallback`` for a message whose own cannot be read.
-- Also the job id its envelope carries (or nil).
local function target_of(message, fallback, queue_prefix, worker_prefix)
  local ok, envelope = pcall(cjson.decode, message)
  if not (ok and type(envelope) == 'table') then return fallback, nil end
  local id = type(envelope.headers) == 'table' and envelope.headers.id or nil
  if type(id) ~= 'string' then id = nil end
  local info = type(envelope.properties) == 'table' and envelope.properties.delivery_info
  local key = type(info) == 'table' and info.routing_key or nil
  if type(key) == 'string' and string.sub(key, 1, #queue_prefix) == queue_prefix
     and string.sub(key, 1, #worker_prefix) ~= worker_prefix then
    return key, id
  end
  return fallback, id
end
"""

HANDBACK = (
    _TARGET_LUA
    + """
-- KEYS[1]: a worker's own queue, KEYS[2]: its routed index. ARGV[1]: how many of its oldest
-- messages to move (0: all); ARGV[2..4]: ``handback_args``.
-- Each message goes back to its shared queue, at the end consumers take from, oldest taken
-- first. One script: a message is in one list or the other, never both, never neither.
local limit = tonumber(ARGV[1])
local moved = {}
while limit == 0 or #moved < limit do
  local message = redis.call('RPOP', KEYS[1])
  if not message then break end
  local target, id = target_of(message, ARGV[2], ARGV[3], ARGV[4])
  -- No longer this worker's to lose: it is back in a shared queue.
  if id then redis.call('ZREM', KEYS[2], id) end
  moved[#moved + 1] = {target, message}
end
for i = #moved, 1, -1 do redis.call('RPUSH', moved[i][1], moved[i][2]) end
return #moved
"""
)
"""Move a worker's routed jobs back to their shared queues (``handback_args``)."""

RECOVER = (
    _TARGET_LUA
    + """
-- KEYS[1]: the routed index of a worker that is gone. ARGV[1]: the job key prefix,
-- ARGV[2..4]: ``handback_args``' last three.
-- Every job routed to it that no worker received and that is still queued: its kept message
-- goes onto its shared queue again (the dead worker's pending BRPOP may have taken it; if it
-- did not, a second delivery of a job is harmless: the claim lets one run). Then the index
-- goes.
local pushed = 0
for _, id in ipairs(redis.call('ZRANGE', KEYS[1], 0, -1)) do
  local job = ARGV[1] .. id
  local fields = redis.call('HMGET', job, 'status', 'message')
  if fields[1] == 'queued' and fields[2] then
    redis.call('RPUSH', (target_of(fields[2], ARGV[2], ARGV[3], ARGV[4])), fields[2])
    redis.call('HDEL', job, 'message')
    pushed = pushed + 1
  end
end
redis.call('DEL', KEYS[1])
return pushed
"""
)
"""Push again the messages of a gone worker's routed jobs that it may have taken with it
(``contracts.keys.routed_key``)."""


def handback_args(limit: int, fallback_queue: str) -> list[str | int]:
    return [limit, fallback_queue, QUEUE_PREFIX, WORKER_QUEUE_PREFIX]
