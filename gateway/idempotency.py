"""``Idempotency-Key``: the same key and body within the TTL is the same job, once.

The first request reserves the key (``SET NX``) as *pending* with the job id it is about to
admit, and marks it *done* once the job is enqueued; if admission is refused, or withdrawn
(its reply lost, its request cut short), it deletes the key, if it still holds it, so a
retry admits afresh. A duplicate that finds the key pending waits for one of the two.
A pending reservation lives only ``PENDING_TTL_S``: a gateway that dies mid-admission can't
block the key for a day (the cost: if it died after enqueueing, a retry after that window
admits a second job).
"""

from __future__ import annotations

import asyncio
import hashlib
import json
from dataclasses import dataclass
from enum import StrEnum
from typing import Any

from pydantic import BaseModel
from redis.asyncio import Redis

from contracts.keys import idempotency_key

POLL_S = 0.05
PENDING_TTL_S = 30


class State(StrEnum):
    PENDING = "pending"
    DONE = "done"


class Entry(BaseModel):
    fingerprint: str
    job_id: str
    state: State


def fingerprint(route: str, body: Any) -> str:
    """A digest of what was asked: the route and the body with keys sorted."""
    canonical = json.dumps([route, body], sort_keys=True, separators=(",", ":"))
    return hashlib.sha256(canonical.encode()).hexdigest()


@dataclass(frozen=True)
class Reservation:
    """``owned``: this request admits ``job_id``; otherwise ``job_id`` was admitted before
    (``conflict``: under a different body)."""

    owned: bool
    job_id: str
    conflict: bool = False


class IdempotencyKeys:
    def __init__(self, redis: Redis, tenant: str, key: str, ttl_s: int) -> None:
        self._redis = redis
        self._key = idempotency_key(tenant, key)
        self._ttl_s = ttl_s

    async def reserve(self, fingerprint: str, job_id: str) -> Reservation:
        """Reserve for ``job_id``, or the earlier job once it is enqueued (waits while the
        earlier request is still admitting it; the caller bounds the wait). A pending entry
        for ``job_id`` itself is this request's own and is held."""
        mine = Entry(fingerprint=fingerprint, job_id=job_id, state=State.PENDING)
        while True:
            if await self._redis.set(self._key, mine.model_dump_json(), nx=True, ex=PENDING_TTL_S):
                return Reservation(owned=True, job_id=job_id)
            raw = await self._redis.get(self._key)
            if raw is None:
                continue  # the earlier request failed and let go: try again
            entry = Entry.model_validate_json(raw)
            if entry.fingerprint != fingerprint:
                return Reservation(owned=False, job_id=entry.job_id, conflict=True)
            if entry.state == State.DONE:
                return Reservation(owned=False, job_id=entry.job_id)
            if entry.job_id == job_id:
                # This request's own, from a try whose release was lost (a job id is minted
                # per request): held still, not waited for.
                return Reservation(owned=True, job_id=job_id)
            await asyncio.sleep(POLL_S)

    async def done(self, fingerprint: str, job_id: str) -> None:
        """Remember ``job_id`` for the key's TTL, unless the reservation lapsed and another
        request holds the key now (it answers for its own job)."""
        entry = Entry(fingerprint=fingerprint, job_id=job_id, state=State.DONE)
        await self._redis.eval(  # type: ignore[misc]
            _DONE, 1, self._key, job_id, entry.model_dump_json(), self._ttl_s
        )

    async def release(self, job_id: str) -> None:
        """Let go of the reservation for ``job_id``, unless it lapsed and is someone else's
        now (a late release after ``PENDING_TTL_S`` must not free a later request's key)."""
        await self._redis.eval(_RELEASE, 1, self._key, job_id)  # type: ignore[misc]


_DONE = """
local entry = redis.call('GET', KEYS[1])
if entry and cjson.decode(entry)['job_id'] ~= ARGV[1] then return 0 end
redis.call('SET', KEYS[1], ARGV[2], 'EX', ARGV[3])
return 1
"""

_RELEASE = """
local entry = redis.call('GET', KEYS[1])
if entry and cjson.decode(entry)['job_id'] == ARGV[1] then return redis.call('DEL', KEYS[1]) end
return 0
"""
