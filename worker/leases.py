"""Keeps the lease of every attempt this worker runs, and stops attempts that lost theirs.

A claim takes the job's lease (``contracts.keys.lease_key``) for ``lease_ttl_s``; this thread
renews all of this worker's leases in one script call every ``refresh_s``. A lease that
expired while Redis was away is taken back if the job's record still names this attempt
(``contracts.job_records.RENEW``). An attempt whose lease another attempt now holds is
stopped (``StopReason.LEASE_LOST``) and writes nothing: its engine request is aborted, its
text and its outcome would be refused anyway.
"""

from __future__ import annotations

import logging
from collections.abc import Callable

from redis import Redis

from contracts.job_records import RENEW, lease_value, renew_call
from worker.background import Periodic
from worker.errors import StopReason
from worker.inflight import InFlight

log = logging.getLogger(__name__)


class LeaseKeeper(Periodic):
    def __init__(
        self,
        redis: Redis,
        worker_id: str,
        inflight: InFlight,
        ttl_s: float,
        refresh_s: float,
        on_outage: Callable[[], None],
    ) -> None:
        self._redis = redis
        self._worker_id = worker_id
        self._inflight = inflight
        self._ttl_s = ttl_s
        self._on_outage = on_outage
        self._renew = redis.register_script(RENEW)
        super().__init__("lease-keeper", refresh_s)

    def step(self) -> list[str]:
        return self.renew()

    def on_redis_error(self, exc: Exception) -> None:
        self._on_outage()

    def renew(self) -> list[str]:
        """Renew every lease of this worker's attempts; stop and return the jobs it lost."""
        running = self._inflight.attempts()
        if not running:
            return []
        leases = [(job_id, lease_value(self._worker_id, n)) for job_id, n in running]
        keys, args = renew_call(leases, self._ttl_s)
        lost = [running[int(position) - 1][0] for position in self._renew(keys=keys, args=args)]
        for job_id in lost:
            log.warning("job %s: this attempt lost its lease to another; stopping it", job_id)
            self._inflight.stop(job_id, StopReason.LEASE_LOST)
        return lost
