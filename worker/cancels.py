"""Stops the jobs this process runs once a caller cancels them (``DELETE /v1/jobs/{id}``).

The gateway marks the record ``cancelled`` and publishes the id on ``JOB_CANCELS``. A
subscription hears it at once; a sweep of the in-flight jobs' statuses every ``poll_s``
catches what the subscription missed (Redis restarting, a reconnect), so a lost message
costs latency, never a cancellation.
"""

from __future__ import annotations

import logging
import threading

from redis import Redis
from redis.exceptions import RedisError

from contracts.job_records import WITHDRAWN
from contracts.jobs import JobStatus
from contracts.keys import JOB_CANCELS
from worker.background import Background
from worker.errors import StopReason
from worker.inflight import InFlight
from worker.job_store import JobStore

log = logging.getLogger(__name__)


class CancelWatcher(Background):
    def __init__(self, redis: Redis, jobs: JobStore, inflight: InFlight, poll_s: float) -> None:
        self._redis = redis
        self._jobs = jobs
        self._inflight = inflight
        self._poll_s = poll_s
        super().__init__("cancel-watcher", self._run, join_timeout_s=poll_s + 5)

    def _run(self, stopping: threading.Event) -> None:
        while not stopping.is_set():
            try:
                with self._redis.pubsub(ignore_subscribe_messages=True) as pubsub:
                    pubsub.subscribe(JOB_CANCELS)
                    while not stopping.is_set():
                        message = pubsub.get_message(timeout=self._poll_s)
                        if message is not None and message["type"] == "message":
                            self._inflight.stop(str(message["data"]), StopReason.CANCELLED)
                        self.sweep()
            except (RedisError, OSError) as exc:
                log.warning("cancel subscription lost (%s); retrying", exc)
                stopping.wait(self._poll_s)

    def sweep(self) -> None:
        """Stop every in-flight job whose record says cancelled (or is gone, or withdrawn)."""
        job_ids = self._inflight.job_ids()
        if not job_ids:
            return
        for job_id, status in self._jobs.statuses(job_ids).items():
            if status is None or status in (JobStatus.CANCELLED, WITHDRAWN):
                self._inflight.stop(job_id, StopReason.CANCELLED)
