"""The delivery schedule in Redis: which events are due, and what each attempt concluded.

``WEBHOOKS_DUE`` (event id -> time of the next attempt) is the only source of truth for
retries, never a Celery countdown (a countdown longer than the broker's visibility timeout
is redelivered, and delivered twice). The dispatcher claims due events by pushing their time
a lease ahead, so an attempt lost with its worker simply becomes due again.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field

from redis import Redis

from contracts.keys import WEBHOOKS_DUE, webhook_event_key
from contracts.webhooks import DeliveryState

CLAIM_DUE = """
local t = redis.call('TIME')
local now = tonumber(t[1]) + tonumber(t[2]) / 1e6
local due = redis.call('ZRANGEBYSCORE', KEYS[1], '-inf', now, 'LIMIT', 0, tonumber(ARGV[2]))
for _, id in ipairs(due) do
  redis.call('ZADD', KEYS[1], 'XX', now + tonumber(ARGV[1]), id)
end
return due
"""

CONCLUDE = """
if redis.call('HGET', KEYS[1], 'state') ~= 'pending' then return 0 end
redis.call('HSET', KEYS[1], 'state', ARGV[2], 'attempts', ARGV[3], 'last_status_code', ARGV[4],
           'last_error', ARGV[5], 'next_attempt_at', ARGV[6], 'delivered_at', ARGV[7],
           'last_attempt_at', ARGV[8])
if ARGV[2] == 'pending' then
  redis.call('ZADD', KEYS[2], tonumber(ARGV[6]), ARGV[1])
else
  redis.call('ZREM', KEYS[2], ARGV[1])
end
return 1
"""


@dataclass(frozen=True)
class Event:
    event_id: str
    url: str
    tenant: str
    kind: str
    subject: str
    state: DeliveryState
    attempts: int
    created_at: float


@dataclass(frozen=True)
class Conclusion:
    """What one attempt decided: delivered, dead, or pending with the next attempt's time."""

    state: DeliveryState
    status_code: int | None
    error: str | None
    next_attempt_at: float | None = None
    delivered_at: float | None = None
    attempted_at: float = field(default_factory=time.time)


class Schedule:
    def __init__(self, redis: Redis) -> None:
        self._redis = redis
        self._claim = redis.register_script(CLAIM_DUE)
        self._conclude = redis.register_script(CONCLUDE)

    def claim_due(self, lease_s: float, limit: int = 100) -> list[str]:
        """Events due now, each leased for ``lease_s``."""
        return [str(e) for e in self._claim(keys=[WEBHOOKS_DUE], args=[lease_s, limit])]

    def event(self, event_id: str) -> Event | None:
        fields: dict[str, str] = self._redis.hgetall(webhook_event_key(event_id))  # type: ignore[assignment]
        if not fields:
            return None
        return Event(
            event_id=event_id,
            url=fields["url"],
            tenant=fields["tenant"],
            kind=fields["kind"],
            subject=fields["subject"],
            state=DeliveryState(fields["state"]),
            attempts=int(fields.get("attempts") or 0),
            created_at=float(fields["created_at"]),
        )

    def conclude(self, event: Event, attempts: int, conclusion: Conclusion) -> bool:
        """Record an attempt; ``False`` if the event was already concluded by another."""
        args = [
            event.event_id,
            conclusion.state.value,
            attempts,
            "" if conclusion.status_code is None else conclusion.status_code,
            conclusion.error or "",
            "" if conclusion.next_attempt_at is None else repr(conclusion.next_attempt_at),
            "" if conclusion.delivered_at is None else repr(conclusion.delivered_at),
            repr(conclusion.attempted_at),
        ]
        keys = [webhook_event_key(event.event_id), WEBHOOKS_DUE]
        return bool(self._conclude(keys=keys, args=args))
