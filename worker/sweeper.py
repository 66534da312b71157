"""Ends jobs whose deadline passed without an outcome: nothing stays admitted forever.

A worker ends every job it runs by the job's deadline, but some jobs are admitted and never
reach a worker that could end them: the gateway died between admission and publish, the
message was lost with a broker, no worker consumes the tier. Every job worker and webhook
worker runs this loop; one of them at a time is elected (``contracts.keys.SWEEPER``, a key
that expires unless its holder renews it) and, every ``interval_s``, fails each job whose
deadline passed more than ``grace_s`` ago (``deadline_exceeded``, saying where the job was
last seen). That write is the usual terminal transition (``contracts.job_records.ADVANCE``):
it releases the job's admission slots, creates its webhook event and counts it in its batch,
once, however many sweepers or workers race on it.
"""

from __future__ import annotations

import logging
import time

from pydantic import ValidationError
from redis import Redis

from contracts.keys import DEADLINES, SWEEPER
from worker.background import Periodic
from worker.job_store import JobStore

log = logging.getLogger(__name__)

ELECT = """
local holder = redis.call('GET', KEYS[1])
if not holder then
  redis.call('SET', KEYS[1], ARGV[1], 'PX', ARGV[2])
  return 1
end
if holder == ARGV[1] then
  redis.call('PEXPIRE', KEYS[1], ARGV[2])
  return 1
end
return 0
"""
"""Take or keep the sweeper's seat for ``ARGV[2]`` ms; 1 if this process holds it."""

BATCH = 200
"""Jobs looked at per sweep (the rest wait for the next one)."""


class DeadlineSweeper(Periodic):
    def __init__(
        self, redis: Redis, jobs: JobStore, owner: str, interval_s: float, grace_s: float
    ) -> None:
        self._redis = redis
        self._jobs = jobs
        self._owner = owner
        self._grace_s = grace_s
        self._elect = redis.register_script(ELECT)
        super().__init__("deadline-sweeper", interval_s)

    def step(self) -> int:
        return self.sweep() if self.elected() else 0

    def elected(self) -> bool:
        """This process holds the sweeper's seat (taken if free) for three intervals."""
        ttl_ms = max(1000, round(3 * self._interval_s * 1000))  # three missed turns
        return bool(self._elect(keys=[SWEEPER], args=[self._owner, ttl_ms]))

    def sweep(self) -> int:
        """Fail every unfinished job whose deadline passed ``grace_s`` ago; how many."""
        cutoff = time.time() - self._grace_s
        due = self._redis.zrangebyscore(DEADLINES, "-inf", cutoff, start=0, num=BATCH)
        ended = 0
        for member in due:  # type: ignore[union-attr]
            job_id = str(member)
            try:
                job = self._jobs.get(job_id)
            except ValidationError as exc:
                # Written by another version, or by hand: it cannot be ended as a job, and
                # left first in the index it would stop every sweep behind it.
                log.error(
                    "job %s: its record does not parse (%s); dropped from the deadline index",
                    job_id,
                    exc.errors(include_url=False)[:3],
                )
                self._redis.zrem(DEADLINES, job_id)
                continue
            if job is None or job.status.terminal:
                # Its record expired, or a terminal write raced this read: nothing to end.
                self._redis.zrem(DEADLINES, job_id)
                continue
            if self._jobs.expire(job):
                ended += 1
                log.warning("job %s ended by the deadline sweeper (was %s)", job_id, job.status)
        return ended
