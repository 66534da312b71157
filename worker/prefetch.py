"""Queue look-ahead: the adapters of jobs waiting for this worker are fetched before the jobs.

Every ``LORAFLEET_PREFETCH_INTERVAL_S`` the worker reads the next ``LORAFLEET_LOOKAHEAD_JOBS``
messages of each queue it takes (its pool's queues of its tiers and its own: one pipelined
round trip of ``LRANGE``s; kombu's Redis transport takes from the right end, so those are the
jobs it takes next). A job in the worker's own queue is waiting for it at first sight (routing
placed it there; no other worker takes it); a job of a shared queue once it is still there at
the next pass (every worker of the pool sees it, and one taken within a pass needs no help). A
job taken while its adapter's prefetch downloads joins that download. The adapters of its base
model that such jobs want and that are not on its disk are downloaded and verified exactly as a
job would (``AdapterCache.prefetch``: the same streaming hash, the same refusal of altered
files, nothing of them kept). Room is made only by evicting entries no running job holds and no
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
from collections import OrderedDict
from collections.abc import Iterable

from redis import Redis

from contracts import popularity
from contracts.jobs import Residency
from contracts.keys import ENGINE_PROVEN_TTL_S, engine_proven_key
from contracts.queues import pool_id
from worker import metrics
from worker.adapter_cache import AdapterCache, NoRoom
from worker.background import Periodic
from worker.errors import JobFailure
from worker.residency import EngineAdapters

log = logging.getLogger(__name__)

PROVEN_KEPT = 4096
"""Digests proven on this engine version kept in memory (the most recently used); a worker
that meets more adapters over its life asks the fleet's set in Redis for the others."""

LOOKAHEAD = "lookahead"
POPULARITY = "popularity"
WARMUP = "warmup"
RETRY_FAILED_S = 30.0
"""A digest whose prefetch failed (download, verification, the engine) is not tried again by
the look-ahead for this long: its jobs fetch it themselves, and fail as they must."""
RETRY_NO_ROOM_S = 5.0
COUNTED_KEEP_S = 120.0
"""How long a waiting job the look-ahead counted in its adapter's request rate is remembered
(for its own fetch not to count it again; jobs another worker took are forgotten then)."""


def waiting_jobs(lists: Iterable[list[str]], base_digest: str) -> list[tuple[str, str, str]]:
    """``(job id, alias, revision)`` of the job messages in ``lists`` (each queue's kombu
    Redis envelopes as ``LRANGE`` returns them: the next to be taken last) for
    ``base_digest``, queue by queue, each queue's next first. A message that does not parse
    is skipped (the worker refuses it when it takes it)."""
    jobs = []
    for raw in (raw for listed in lists for raw in reversed(list(listed))):
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
    """Look-ahead prefetching for one worker, and with ``popularity`` > 0 the pool's most
    asked-for adapters too (``LORAFLEET_PREDICTION=popularity``)."""

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
        popularity: int = 0,
        popularity_check_s: float = 5.0,
        engine_version: str = "",
    ) -> None:
        super().__init__("prefetch", interval_s)
        self._redis = redis
        self._adapters = adapters
        self._cache = cache
        self._base_digest = base_digest
        self._pool_id = pool_id(base_digest)
        self._queues = queues
        self._lookahead_jobs = lookahead_jobs
        self._popularity = popularity
        self._popularity_check_s = popularity_check_s
        self._popularity_at = 0.0
        self._pool = concurrent.futures.ThreadPoolExecutor(downloads, "prefetch")
        self._slots = threading.Semaphore(downloads)
        self._lock = threading.Lock()
        self._busy: set[str] = set()  # digests being prefetched now
        self._not_before: dict[str, float] = {}  # digest -> when a prefetch may try again
        # digest -> the levels a prefetch brought it to (``disk``, ``cpu``), until it leaves
        # them, and the trigger of that prefetch; ``_unused``: those no job found there yet.
        self._levels: dict[str, set[str]] = {}
        self._trigger: dict[str, str] = {}
        self._unused: set[str] = set()
        self._seen: set[str] = set()  # job ids waiting at the last pass
        self._joined: set[str] = set()  # digests a job waits for the prefetch's download of
        self._credited: set[str] = set()  # ... and whose prefetch was counted used for it
        self._proven_key = engine_proven_key(engine_version)
        self._proven: OrderedDict[str, None] = OrderedDict()  # recently used last
        self._to_announce: list[str] = []
        adapters.on_proven = self.proven
        # Job id -> when: waiting jobs whose request the disk cache's rate counts already.
        self._counted: dict[str, float] = {}
        cache.on_evict = self._evicted

    def close(self) -> None:
        super().close()
        self._pool.shutdown(wait=False, cancel_futures=True)

    def step(self) -> None:
        self._lookahead()
        if self._popularity and time.monotonic() >= self._popularity_at:
            self._popularity_at = time.monotonic() + self._popularity_check_s
            for alias, revision in self._popular():
                if not self._submit(alias, revision, POPULARITY, None):
                    break

    def _lookahead(self) -> None:
        try:
            self._write_proven()
        except Exception as exc:  # kept for the next pass; the look-ahead goes on
            log.warning("adapters this engine loaded not recorded yet: %r", exc)
        pipe = self._redis.pipeline(transaction=False)
        for queue in self._queues:
            pipe.lrange(queue, -self._lookahead_jobs, -1)
        lists = pipe.execute()
        # The worker's own queue (routing placed those jobs here: no other worker takes
        # them) counts at first sight; a shared queue's job once it is still there at the
        # next pass (every worker of the pool sees it; one taken within a pass needs no help).
        own = {job_id for job_id, _, _ in waiting_jobs(lists[:1], self._base_digest)}
        jobs = waiting_jobs(lists, self._base_digest)
        seen, self._seen = self._seen, {job_id for job_id, _, _ in jobs}
        seen |= own
        wanted: dict[str, str] = {}  # revision -> alias, the next job's first
        asking: list[str] = []  # a waiting job asks for it, counted once
        now = time.monotonic()
        with self._lock:
            self._counted = {
                job_id: at for job_id, at in self._counted.items() if at > now - COUNTED_KEEP_S
            }
            for job_id, alias, revision in jobs:
                if job_id in seen:
                    wanted.setdefault(revision, alias)
                    if job_id not in self._counted:
                        self._counted[job_id] = now
                        asking.append(revision)
        for revision in asking:  # not under our lock: the cache calls us under its own
            self._cache.expect(revision)
        protect = frozenset(revision for _, _, revision in jobs)
        for revision, alias in wanted.items():
            if not self._submit(alias, revision, LOOKAHEAD, protect):
                return

    def _popular(self) -> list[tuple[str, str]]:
        """``(alias, revision)`` of the pool's ``popularity`` most asked-for adapters, the
        most first (one pipelined round trip: this epoch's set and the last one's)."""
        now = time.time()
        epoch = popularity.epoch_of(now)
        pipe = self._redis.pipeline(transaction=False)
        for which in (epoch, epoch - 1):
            key = popularity.popularity_key(self._pool_id, which)
            pipe.zrevrange(key, 0, -1, withscores=True)
        current, previous = pipe.execute()
        counts = popularity.decayed(current, previous, now, epoch)
        return [(alias, d) for d, alias, _ in popularity.top(counts, self._popularity)]

    def _submit(
        self, alias: str, revision: str, trigger: str, protect: frozenset[str] | None
    ) -> bool:
        """Start a prefetch of ``revision`` unless there is nothing to do; False when as many
        are under way as allowed (try the rest next pass). ``protect``: what the download
        may not evict (``None``: anything on disk: popularity only takes free room)."""
        with self._lock:
            if revision in self._busy or self._not_before.get(revision, 0) > time.monotonic():
                return True
        if self._cache.has(revision) and not self._engine_step_due(revision):
            return True
        if not self._slots.acquire(blocking=False):
            return False
        with self._lock:
            self._busy.add(revision)
        self._pool.submit(self._prefetch, alias, revision, trigger, protect)
        return True

    def _engine_step_due(self, revision: str) -> bool:
        """``revision`` (on disk) may be registered in the engine now: an engine of this
        version loaded it before, the engine has room, and does not hold it."""
        return (
            self._adapters.engine_has_room()
            and not self._adapters.holds(revision)
            and self._is_proven(revision)
        )

    def proven(self, digest: str) -> None:
        """The engine loaded ``digest`` and survived (on the engine loop: no blocking)."""
        with self._lock:
            if digest not in self._proven:
                self._to_announce.append(digest)
            self._keep_proven(digest)

    def _keep_proven(self, digest: str) -> None:
        """Remember ``digest`` as proven (under the lock), forgetting the least recently used
        past ``PROVEN_KEPT``: Redis's set answers for those."""
        self._proven[digest] = None
        self._proven.move_to_end(digest)
        while len(self._proven) > PROVEN_KEPT:
            self._proven.popitem(last=False)

    def _write_proven(self) -> None:
        with self._lock:
            digests, self._to_announce = self._to_announce, []
        if digests:
            pipe = self._redis.pipeline(transaction=False)
            pipe.sadd(self._proven_key, *digests)
            pipe.expire(self._proven_key, ENGINE_PROVEN_TTL_S)
            try:
                pipe.execute()
            except Exception:
                with self._lock:
                    self._to_announce += digests
                raise

    def _is_proven(self, digest: str) -> bool:
        with self._lock:
            if digest in self._proven:
                self._proven.move_to_end(digest)
                return True
        if self._redis.sismember(self._proven_key, digest):
            with self._lock:
                self._keep_proven(digest)
            return True
        return False

    def warm_up(self, timeout_s: float) -> int:
        """Before the worker takes jobs: fetch the pool's most asked-for adapters into free
        disk room and free engine places, as many at a time as the look-ahead's downloads,
        for at most ``timeout_s`` (those still under way then go on while the worker serves).
        How many it made resident in time."""
        if not self._popularity:
            return 0
        deadline = time.monotonic() + timeout_s
        try:
            popular = self._popular()
        except Exception as exc:  # Redis away: start cold rather than not at all
            log.warning("no warm-up: the pool's popularity could not be read (%s)", exc)
            return 0
        started: list[concurrent.futures.Future[bool]] = []
        for alias, revision in popular:
            remaining = deadline - time.monotonic()
            if remaining <= 0 or self.stopping.is_set():
                break
            if not self._slots.acquire(timeout=remaining):
                break
            with self._lock:
                self._busy.add(revision)
            started.append(self._pool.submit(self._prefetch, alias, revision, WARMUP, None))
        finished, _ = concurrent.futures.wait(
            started, timeout=max(0.0, deadline - time.monotonic())
        )
        return sum(1 for future in finished if not future.cancelled() and future.result())

    def _prefetch(
        self, alias: str, revision: str, trigger: str, protect: frozenset[str] | None
    ) -> bool:
        """Fetch (into room ``protect`` allows) and register ``revision``; True if it made
        it resident anywhere. Releases the slot and the busy mark it was given."""
        made = False
        try:
            with self._cache.hold(revision):
                verified = None
                if not self._cache.has(revision):
                    metrics.PREFETCHES.labels(trigger, "started").inc()
                    fetched = (
                        self._cache.prefetch(revision, protect)
                        if protect is not None
                        else self._cache.prefetch(revision, frozenset(), evict=False)
                    )
                    if fetched is not None:
                        self._reached(revision, "disk", trigger)
                        verified = fetched.loaded_digest
                        made = True
                if (
                    self._cache.has(revision)
                    and not self.stopping.is_set()
                    and self._engine_step_due(revision)
                ):
                    if verified is None:  # hashed here, before a GPU slot is taken
                        verified = self._cache.verify(revision)[0]
                    if self._adapters.prefetch_into_engine(
                        alias,
                        revision,
                        verified,
                        lambda started: self._mark(revision, "cpu", trigger, started),
                    ):
                        metrics.PREFETCHES.labels(trigger, "cpu").inc()
                        made = True
                    else:  # no room after all: not hashed again before a while
                        with self._lock:
                            self._not_before[revision] = time.monotonic() + RETRY_NO_ROOM_S
        except NoRoom:
            with self._lock:
                self._not_before[revision] = time.monotonic() + RETRY_NO_ROOM_S
        except Exception as exc:
            metrics.PREFETCHES.labels(trigger, "failed").inc()
            reason = exc.message if isinstance(exc, JobFailure) else repr(exc)
            log.warning("%s prefetch of %s (%s) failed: %s", trigger, alias, revision, reason)
            with self._lock:
                self._not_before[revision] = time.monotonic() + RETRY_FAILED_S
        finally:
            with self._lock:
                self._busy.discard(revision)
                self._joined.discard(revision)
                self._credited.discard(revision)
                now = time.monotonic()
                self._not_before = {d: t for d, t in self._not_before.items() if t > now}
            self._slots.release()
        return made

    def _reached(self, revision: str, level: str, trigger: str) -> None:
        metrics.PREFETCHES.labels(trigger, level).inc()
        self._mark(revision, level, trigger, True)

    def _mark(self, revision: str, level: str, trigger: str, reached: bool) -> None:
        with self._lock:
            if reached:
                self._levels.setdefault(revision, set()).add(level)
                self._trigger[revision] = trigger
                if revision in self._joined:  # a job took it as it arrived
                    self._joined.discard(revision)
                    self._credited.add(revision)
                    metrics.PREFETCHES.labels(trigger, "used").inc()
                elif revision not in self._credited:  # (its engine step is that job's too)
                    self._unused.add(revision)
            elif revision in self._levels:
                levels = self._levels[revision]
                levels.discard(level)
                if not levels:  # it reached no level after all: nothing to use or waste
                    del self._levels[revision]
                    self._trigger.pop(revision, None)
                    self._unused.discard(revision)

    def _evicted(self, digest: str) -> None:
        """The disk cache dropped ``digest`` (its lock held: no blocking here)."""
        with self._lock:
            self._levels.pop(digest, None)
            trigger = self._trigger.pop(digest, LOOKAHEAD)
            if digest in self._unused:
                self._unused.discard(digest)
                metrics.PREFETCHES.labels(trigger, "wasted").inc()

    def counted_ahead(self, job_id: str) -> bool:
        """The look-ahead counted ``job_id`` in its adapter's request rate while it waited
        (its own fetch then does not count it again)."""
        with self._lock:
            return self._counted.pop(job_id, None) is not None

    def found(self, digest: str, residency: Residency) -> bool:
        """A job found ``digest`` at ``residency``: whether a prefetch brought it there."""
        with self._lock:
            if residency == "remote" and digest in self._busy:
                self._joined.add(digest)  # it waits for the prefetch's download: a use
            levels = self._levels.get(digest)
            if levels is None:
                return False
            if residency == "remote":
                del self._levels[digest]
                self._trigger.pop(digest, None)
                self._unused.discard(digest)
                return False
            if residency == "disk":
                levels.discard("cpu")  # the engine dropped it since
            prefetched = residency in levels
            if prefetched and digest in self._unused:
                self._unused.discard(digest)
                metrics.PREFETCHES.labels(self._trigger.get(digest, LOOKAHEAD), "used").inc()
            return prefetched


class NoPrefetch:
    """``LORAFLEET_PREDICTION=off``."""

    def start(self) -> None:
        pass

    def warm_up(self, timeout_s: float) -> int:
        return 0

    def counted_ahead(self, job_id: str) -> bool:
        return False

    def close(self) -> None:
        pass

    def found(self, digest: str, residency: Residency) -> bool:
        return False
