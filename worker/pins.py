"""A worker's pinned adapters follow its pool's hot adapters while it runs.

At start the worker pins the hot adapters of its base model (if it takes the hot tier) in
``LORAFLEET_MAX_LORAS - 1`` GPU slots. Afterwards every registry change that can change them
(a publish, a retirement) bumps ``lorafleet:registry-version``; the keeper reads that counter
every ``LORAFLEET_PIN_CHECK_S`` (one GET) and, when it moved, compares the pins with the hot
adapters of the base model now: a new one is pinned live (``EngineAdapters.pin_live``: it
waits for a GPU slot like a job, so no generating job loses its adapter), a retired one is
unpinned (``EngineAdapters.unpin``). Pins that are still hot stay; new ones fill the free
slots in alias order (publishing refuses more than fit, ``pins_exceed_slots``; a registry
written while no worker lived may hold more: the rest are served unpinned, and logged).
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable
from contextlib import ExitStack

from redis import Redis

from contracts.keys import REGISTRY_VERSION
from contracts.registry import AdapterRecord
from worker import metrics
from worker.adapter_cache import AdapterCache
from worker.background import Periodic
from worker.errors import JobFailure
from worker.registry import preload_sets
from worker.residency import EngineAdapters

log = logging.getLogger(__name__)

LIVE_PIN_TIMEOUT_S = 300.0
"""How long a live pin may wait (for its download and a GPU slot); then it is tried again."""
RETRY_FAILED_S = 30.0
"""A pass that failed (a pin: download, verification, the engine; an error) is tried again
this much later, doubling after each failure up to ``RETRY_MAX_S``; a registry change tries at
once."""
RETRY_MAX_S = 600.0


class Pins(Periodic):
    """The adapters this worker has pinned, kept equal to its pool's hot ones while it runs."""

    def __init__(
        self,
        redis: Redis,
        adapters: EngineAdapters,
        cache: AdapterCache,
        base_digest: str,
        takes_hot: bool,
        max_loras: int,
        interval_s: float,
        on_change: Callable[[], None],
    ) -> None:
        super().__init__("pins", interval_s)
        self._redis = redis
        self._adapters = adapters
        self._cache = cache
        self._base_digest = base_digest
        self._takes_hot = takes_hot
        self._room = max_loras - 1  # one slot stays free for every other adapter
        self._on_change = on_change
        # digest -> (engine name, disk hold); changed by this thread, read by the heartbeat's
        self._pinned: dict[str, tuple[str, ExitStack]] = {}
        self._lock = threading.Lock()
        self._seen_version: str | None = None
        self._stale = True
        self._retry_at = 0.0
        self._failures = 0

    @property
    def names(self) -> list[str]:
        """Engine names (``alias@digest prefix``) of the pinned adapters, in pin order."""
        with self._lock:
            return [name for name, _ in self._pinned.values()]

    def desired(self) -> tuple[list[AdapterRecord], list[AdapterRecord]]:
        """The registry's active hot adapters of this base model this worker should pin (none
        if it does not take the hot tier) and those beyond its slots; the registry version
        read first, so a change while this runs is seen next time."""
        self._seen_version = self._version()
        hot, _ = preload_sets(self._redis, self._base_digest)
        if not self._takes_hot:
            return [], []
        pinned = self._held()
        keep = [record for record in hot if record.digest in pinned]
        new = [record for record in hot if record.digest not in pinned]
        room = max(0, self._room - len(keep))
        return [*keep, *new[:room]], new[room:]

    def pin_at_start(self, records: list[AdapterRecord]) -> None:
        """Pin ``records`` before the worker takes jobs (one that fails is tried again live,
        ``RETRY_FAILED_S`` later)."""
        failed = False
        for record in records:
            failed = not self._pin(record, live=False) or failed
        if failed:
            self._failed()
        else:
            self._stale = False

    def step(self) -> None:
        changed = self._version() != self._seen_version
        if changed or (self._stale and time.monotonic() >= self._retry_at):
            if changed:
                self._failures = 0
            try:
                self.reconcile()
            except Exception:
                self._failed()
                raise

    def _failed(self) -> None:
        self._stale = True
        delay = min(RETRY_MAX_S, RETRY_FAILED_S * 2**self._failures)
        self._failures += 1
        self._retry_at = time.monotonic() + delay

    def reconcile(self) -> None:
        """Pin what became hot, unpin what no longer is. A pass that did not end with every
        pin in place is tried again (a failed pin ``RETRY_FAILED_S`` later)."""
        self._stale = True  # until this pass has ended without an error
        wanted, beyond = self.desired()
        if beyond:
            log.error(
                "%d hot adapters beyond this worker's %d pin slots: %s served unpinned",
                len(beyond),
                self._room,
                ", ".join(record.alias for record in beyond),
            )
        wanted_digests = {record.digest for record in wanted}
        gone = [d for d in self._held() if d not in wanted_digests]
        for digest in gone:
            if self.stopping.is_set():
                return
            self._adapters.unpin(digest)
            with self._lock:
                name, hold = self._pinned.pop(digest, ("", ExitStack()))
            hold.close()
            log.info("unpinned %s (no longer a hot adapter of this pool)", name)
            self._changed()
        failed = False
        for record in wanted:
            if self.stopping.is_set():
                return
            with self._lock:
                pinned = record.digest in self._pinned
            if not pinned:
                failed = not self._pin(record, live=True) or failed
        if failed:
            self._failed()
            return
        self._stale = False
        self._failures = 0

    def _pin(self, record: AdapterRecord, live: bool) -> bool:
        """Pin ``record`` (False: it could not be, logged)."""
        hold = ExitStack()
        hold.enter_context(self._cache.hold(record.digest))
        try:
            if live:
                self._adapters.pin_live(record.alias, record.digest, LIVE_PIN_TIMEOUT_S)
            else:
                self._adapters.pin(record.alias, record.digest)
        except JobFailure as failure:
            hold.close()
            log.error("hot adapter %s not pinned: %s", record.alias, failure.message)
            return False
        except BaseException:
            if record.digest not in self._adapters.pinned_digests:
                hold.close()
                raise
            # Given up while the engine pinned it all the same: it is pinned, keep it so.
        name = self._adapters.request_for(record.alias, record.digest).lora_name
        with self._lock:
            if self.stopping.is_set():
                hold.close()
                return True
            self._pinned[record.digest] = (name, hold)
        if live:
            log.info("pinned %s (published hot while this worker runs)", name)
        self._changed()
        return True

    def _held(self) -> set[str]:
        """Digests pinned here: recorded, and any the engine pinned after its pin was given
        up (a timeout during ``pin_lora``), so that those are kept or unpinned too."""
        with self._lock:
            recorded = set(self._pinned)
        return recorded | self._adapters.pinned_digests

    def _changed(self) -> None:
        metrics.RESIDENT.labels("gpu").set(len(self.names))
        self._on_change()

    def _version(self) -> str | None:
        raw = self._redis.get(REGISTRY_VERSION)
        return None if raw is None else str(raw)

    def close(self) -> None:
        """Stop reconciling (a pin or unpin under way ends with the engine) and let go of the
        pinned adapters' disk holds."""
        super().close()
        with self._lock:
            pinned, self._pinned = self._pinned, {}
        for _, hold in pinned.values():
            hold.close()
