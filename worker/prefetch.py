"""Queue look-ahead: the adapters of jobs waiting for this worker are fetched before the jobs.

Every ``LORAFLEET_PREFETCH_INTERVAL_S`` the worker reads the next ``LORAFLEET_LOOKAHEAD_JOBS``
messages of each queue it takes (its pool's queues of its tiers and its own: one pipelined
round trip of ``LRANGE``s; kombu's Redis transport takes from the right end, so those are the
jobs it takes next). A job still there at the next pass is waiting (one taken within a pass
needs no help, and its own fetch is timed as its own). The adapters of its base model that
such jobs want and that are not on its disk are downloaded and verified exactly as a job
would (``AdapterCache.prefetch``: the same streaming hash, the same refusal of altered files,
nothing of them kept). Room is made only by evicting entries no running job holds and no
waiting job wants; there being none, the prefetch is skipped. A prefetched adapter is then
registered in the engine while that costs nothing: a free place in its CPU cache, and no job
waiting for a GPU slot (``EngineAdapters.prefetch_into_engine``).

Identity rules do not change: a job still verifies the files it hands the engine against the
digest it was admitted with. The job's metadata says ``prefetched: true`` when the level it
found its adapter at (``disk`` or ``cpu``) was reached by a prefetch; metrics count prefetches
started, made resident, used, wasted (evicted before any job found them) and failed.
"""

from __future__ import annotations

import base64
import concurrent.futures
import json
import logging
import threading
import time
from collections.abc import Iterable

from redis import Redis

from contracts.jobs import Residency
from worker import metrics
from worker.adapter_cache import AdapterCache, NoRoom
from worker.background import Periodic
from worker.errors import JobFailure
from worker.residency import EngineAdapters

log = logging.getLogger(__name__)

LOOKAHEAD = "lookahead"
RETRY_FAILED_S = 30.0
"""A digest whose prefetch failed (download, verification, the engine) is not tried again by
the look-ahead for this long: its jobs fetch it themselves, and fail as they must."""
RETRY_NO_ROOM_S = 5.0


def waiting_jobs(raws: Iterable[str], base_digest: str) -> list[tuple[str, str, str]]:
    """``(job id, alias, revision)`` of the job messages ``raws`` (kombu's Redis envelopes,
    as ``LRANGE`` returns them: the next to be taken last) for ``base_digest``, the next
    first. A message that does not parse is skipped (the worker refuses it when it takes
    it)."""
    jobs = []
    for raw in reversed(list(raws)):
        try:
            envelope = json.loads(raw)
            job = json.loads(base64.b64decode(envelope["body"]))[0][0]
            if job["base_model"]["digest"] != base_digest:
                continue
            jobs.append((str(job["job_id"]), str(job["adapter"]), str(job["revision"])))
        except (ValueError, KeyError, IndexError, TypeError):
            continue
    return jobs


class Prefetcher(Periodic):
    """Look-ahead prefetching for one worker (``LORAFLEET_PREDICTION=lookahead``)."""

    def __init__(
        self,
        redis: Redis,
        adapters: EngineAdapters,
        cache: AdapterCache,
        base_digest: str,
        queues: list[str],
        lookahead_jobs: int,
        interval_s: float,
        downloads: int = 2,
    ) -> None:
        super().__init__("prefetch", interval_s)
        self._redis = redis
        self._adapters = adapters
        self._cache = cache
        self._base_digest = base_digest
        self._queues = queues
        self._lookahead_jobs = lookahead_jobs
        self._pool = concurrent.futures.ThreadPoolExecutor(downloads, "prefetch")
        self._slots = threading.Semaphore(downloads)
        self._lock = threading.Lock()
        self._busy: set[str] = set()  # digests being prefetched now
        self._not_before: dict[str, float] = {}  # digest -> when the look-ahead may try again
        # digest -> the levels a prefetch brought it to (``disk``, ``cpu``), until it leaves
        # them; ``_unused``: those no job has found there yet.
        self._levels: dict[str, set[str]] = {}
        self._unused: set[str] = set()
        self._seen: set[str] = set()  # job ids waiting at the last pass
        cache.on_evict = self._evicted

    def close(self) -> None:
        super().close()
        self._pool.shutdown(wait=False, cancel_futures=True)

    def step(self) -> None:
        pipe = self._redis.pipeline(transaction=False)
        for queue in self._queues:
            pipe.lrange(queue, -self._lookahead_jobs, -1)
        raws = [raw for listed in pipe.execute() for raw in listed]
        jobs = waiting_jobs(raws, self._base_digest)
        seen, self._seen = self._seen, {job_id for job_id, _, _ in jobs}
        wanted: dict[str, str] = {}  # revision -> alias, the next job's first
        for job_id, alias, revision in jobs:
            if job_id in seen:
                wanted.setdefault(revision, alias)
        if not wanted:
            return
        protect = frozenset(revision for _, _, revision in jobs)
        now = time.monotonic()
        with self._lock:
            self._not_before = {d: t for d, t in self._not_before.items() if t > now}
        for revision, alias in wanted.items():
            with self._lock:
                if revision in self._busy or revision in self._not_before:
                    continue
            with self._lock:
                if "cpu" in self._levels.get(revision, ()):
                    continue
            if self._cache.has(revision) and (
                not self._adapters.engine_has_room() or self._adapters.holds(revision)
            ):
                continue
            if not self._slots.acquire(blocking=False):
                return  # as many prefetches as allowed are under way: next pass
            with self._lock:
                self._busy.add(revision)
            self._pool.submit(self._prefetch, alias, revision, protect)

    def _prefetch(self, alias: str, revision: str, protect: frozenset[str]) -> None:
        try:
            with self._cache.hold(revision):
                if not self._cache.has(revision):
                    metrics.PREFETCHES.labels(LOOKAHEAD, "started").inc()
                    if self._cache.prefetch(revision, protect) is not None:
                        self._reached(revision, "disk")
                if self._cache.has(revision) and self._adapters.prefetch_into_engine(
                    alias, revision, lambda started: self._mark(revision, "cpu", started)
                ):
                    metrics.PREFETCHES.labels(LOOKAHEAD, "cpu").inc()
        except NoRoom:
            with self._lock:
                self._not_before[revision] = time.monotonic() + RETRY_NO_ROOM_S
        except JobFailure as failure:
            metrics.PREFETCHES.labels(LOOKAHEAD, "failed").inc()
            log.warning("prefetch of %s (%s) failed: %s", alias, revision, failure.message)
            with self._lock:
                self._not_before[revision] = time.monotonic() + RETRY_FAILED_S
        except Exception:
            metrics.PREFETCHES.labels(LOOKAHEAD, "failed").inc()
            log.exception("prefetch of %s (%s) failed", alias, revision)
            with self._lock:
                self._not_before[revision] = time.monotonic() + RETRY_FAILED_S
        finally:
            with self._lock:
                self._busy.discard(revision)
            self._slots.release()

    def _reached(self, revision: str, level: str) -> None:
        metrics.PREFETCHES.labels(LOOKAHEAD, level).inc()
        self._mark(revision, level, True)

    def _mark(self, revision: str, level: str, reached: bool) -> None:
        with self._lock:
            if reached:
                self._levels.setdefault(revision, set()).add(level)
                self._unused.add(revision)
            else:
                self._levels.get(revision, set()).discard(level)

    def _evicted(self, digest: str) -> None:
        """The disk cache dropped ``digest`` (its lock held: no blocking here)."""
        with self._lock:
            self._levels.pop(digest, None)
            if digest in self._unused:
                self._unused.discard(digest)
                metrics.PREFETCHES.labels(LOOKAHEAD, "wasted").inc()

    def found(self, digest: str, residency: Residency) -> bool:
        """A job found ``digest`` at ``residency``: whether a prefetch brought it there."""
        with self._lock:
            levels = self._levels.get(digest)
            if levels is None:
                return False
            if residency == "remote":
                del self._levels[digest]
                self._unused.discard(digest)
                return False
            if residency == "disk":
                levels.discard("cpu")  # the engine dropped it since
            prefetched = residency in levels
            if prefetched and digest in self._unused:
                self._unused.discard(digest)
                metrics.PREFETCHES.labels(LOOKAHEAD, "used").inc()
            return prefetched


class NoPrefetch:
    """``LORAFLEET_PREDICTION=off``."""

    def start(self) -> None:
        pass

    def close(self) -> None:
        pass

    def found(self, digest: str, residency: Residency) -> bool:
        return False
