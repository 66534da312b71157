"""Where an adapter lives (engine, disk, S3), observed, and how it gets into the engine.

The engine knows an adapter as ``alias@<digest prefix>`` with an integer id fixed for that
digest in this process, so two revisions never share a name or an id (vLLM keys its caches
by both).
"""

from __future__ import annotations

import threading
import time
from dataclasses import dataclass

from vllm.lora.request import LoRARequest

from contracts.digests import short
from contracts.jobs import LoadTimings, Residency
from worker.adapter_cache import AdapterCache
from worker.engine import EngineHost
from worker.errors import AdapterIntegrityError


@dataclass(frozen=True)
class Resident:
    """An adapter ready in the engine, with what this job observed on the way."""

    request: LoRARequest
    residency_before: Residency
    loaded_digest: str
    load_ms: LoadTimings


class EngineAdapters:
    """Makes verified adapters resident in the engine, once per digest at a time."""

    def __init__(self, host: EngineHost, cache: AdapterCache) -> None:
        self._host = host
        self._cache = cache
        self._guard = threading.Lock()
        self._ids: dict[str, int] = {}
        self._handed: dict[int, str] = {}
        self._pinned: set[int] = set()
        self._locks: dict[str, threading.Lock] = {}

    def _id_for(self, digest: str) -> int:
        with self._guard:
            if digest not in self._ids:
                self._ids[digest] = len(self._ids) + 1
            return self._ids[digest]

    def _lock_for(self, digest: str) -> threading.Lock:
        with self._guard:
            return self._locks.setdefault(digest, threading.Lock())

    def registered(self) -> set[int]:
        """Adapter ids the engine holds right now (its own answer, not our bookkeeping)."""
        return set(self._host.run(self._host.engine.list_loras()))

    def observe(self, digest: str) -> Residency:
        """Residency of ``digest`` at this instant: engine (pinned or not), disk or remote."""
        lora_id = self._id_for(digest)
        if lora_id in self.registered():
            return "gpu" if lora_id in self._pinned else "cpu"
        return "disk" if self._cache.has(digest) else "remote"

    def make_resident(self, alias: str, digest: str) -> Resident:
        """Ensure ``digest`` is registered in the engine from files verified against it."""
        lora_id = self._id_for(digest)
        request = LoRARequest(
            lora_name=f"{alias}@{short(digest)}",
            lora_int_id=lora_id,
            lora_path=str(self._cache.path_for(digest)),
        )
        before = self.observe(digest)
        timings = LoadTimings()
        with self._lock_for(digest):
            if lora_id in self.registered():
                return Resident(request, before, self._handed[lora_id], timings)
            fetched = self._cache.ensure(digest)
            timings.fetch = fetched.fetch_ms
            if fetched.loaded_digest is None:
                loaded, timings.verify = self._cache.verify(digest)
            else:
                loaded, timings.verify = fetched.loaded_digest, fetched.verify_ms
            if loaded != digest:
                raise AdapterIntegrityError(f"Files for {digest} hash to {loaded}; refused.")
            start = time.perf_counter()
            self._host.run(self._host.engine.add_lora(request))
            timings.engine_load = round((time.perf_counter() - start) * 1000, 3)
            self._handed[lora_id] = loaded
        return Resident(request, before, loaded, timings)

    def handed_digest(self, request: LoRARequest) -> str | None:
        """Digest of the files last handed to the engine under ``request``'s id."""
        return self._handed.get(request.lora_int_id)
