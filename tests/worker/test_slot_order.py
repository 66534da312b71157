"""A job asks the engine to load its adapter only once it holds a GPU adapter slot.

``add_lora`` activates the adapter into a GPU slot at once, evicting the least recently used
unpinned one (vLLM's ``LRUCacheLoRAModelManager.activate_adapter``). A job that loaded its
adapter and then waited for a slot evicted the adapter of a job that was generating, and the
engine's next step swapped it back: with more distinct adapters than slots, every waiting
job cost the running ones a slot swap (and, past ``max_cpu_loras``, a reload from disk).

Pure logic: the real ``JobRunner``, ``EngineAdapters``, ``SlotGate`` and ``EngineHost`` loop,
with an engine stand-in that records, at each ``add_lora``, which adapters held GPU slots.
"""

from __future__ import annotations

import threading
import time
from collections.abc import AsyncIterator, Iterator
from contextlib import contextmanager
from pathlib import Path
from types import SimpleNamespace
from typing import Any

from vllm.lora.request import LoRARequest

from contracts.jobs import JobMessage, Sampling
from contracts.queues import Tier
from contracts.registry import BaseModelRef
from worker.adapter_cache import Fetched
from worker.engine import EngineHost
from worker.inflight import Running
from worker.residency import EngineAdapters
from worker.runner import JobRunner

BASE = BaseModelRef(id="tiny", digest="sha256:" + "b" * 64)


class Engine:
    """Generates one token per request once its adapter's gate is opened by the test."""

    errored = False

    def __init__(self, adapters: list[EngineAdapters]) -> None:
        self._adapters = adapters
        self.registered: set[int] = set()
        self.loads: list[tuple[int, set[int]]] = []  # (adapter id, ids holding slots then)
        self.generating: dict[int, threading.Event] = {}
        self.release: dict[int, threading.Event] = {}

    async def add_lora(self, request: LoRARequest) -> bool:
        holding = set(self._adapters[0]._gate._active)
        self.loads.append((request.lora_int_id, holding))
        self.registered.add(request.lora_int_id)
        return True

    async def list_loras(self) -> set[int]:
        return set(self.registered)

    async def generate(
        self, prompt: Any, params: Any, request_id: str, lora_request: LoRARequest, **_: Any
    ) -> AsyncIterator[Any]:
        lora_id = lora_request.lora_int_id
        self.generating.setdefault(lora_id, threading.Event()).set()
        release = self.release.setdefault(lora_id, threading.Event())
        while not release.is_set():
            await _sleep()
        yield SimpleNamespace(
            prompt_token_ids=[1],
            outputs=[SimpleNamespace(token_ids=[2], text="x", finish_reason="length")],
            metrics=None,
        )


async def _sleep() -> None:
    import asyncio

    await asyncio.sleep(0.005)


class Cache:
    """Every adapter is on disk and hashes to its digest."""

    def path_for(self, digest: str) -> Path:
        return Path("/nowhere") / digest[-8:]

    def has(self, digest: str) -> bool:
        return True

    @contextmanager
    def hold(self, digest: str) -> Iterator[None]:
        yield

    def ensure(
        self, digest: str, deadline_at: float | None = None, check: Any = None, count: bool = True
    ) -> Fetched:
        return Fetched(self.path_for(digest), None, None, None)

    def verify(self, digest: str) -> tuple[str, float]:
        return digest, 0.1


class Deltas:
    def publish(self, job_id: str, attempt: int, text: str) -> None: ...

    def discard(self, job_id: str, attempt: int) -> None: ...


def _message(job_id: str, adapter: str) -> JobMessage:
    now = time.time()
    return JobMessage(
        job_id=job_id,
        tenant="t",
        adapter=adapter,
        revision="sha256:" + adapter.rjust(64, "0"),
        base_model=BASE,
        tier=Tier.WARM,
        prompt="hello",
        sampling=Sampling(max_tokens=1, temperature=0.0),
        accepted_at=now,
        deadline_at=now + 60,
    )


def _wait_for(condition: Any, what: str) -> None:
    for _ in range(2000):
        if condition():
            return
        time.sleep(0.005)
    raise AssertionError(f"timed out waiting for {what}")


def test_a_job_waiting_for_a_slot_has_not_loaded_its_adapter_into_the_engine() -> None:
    host = EngineHost(options=None)  # type: ignore[arg-type]
    holder: list[EngineAdapters] = []
    engine = Engine(holder)
    host._thread.start()
    host._engine = engine  # type: ignore[assignment]
    adapters = EngineAdapters(host, Cache(), max_loras=1)  # type: ignore[arg-type]
    holder.append(adapters)
    runner = JobRunner(host, Cache(), adapters, BASE, "w", Deltas())  # type: ignore[arg-type]
    results: dict[str, Any] = {}

    def run(job_id: str, adapter: str) -> None:
        try:
            results[job_id] = runner.run(_message(job_id, adapter), Running(job_id, 1))
        except BaseException as exc:  # reported by the assertions below
            results[job_id] = exc

    a = threading.Thread(target=run, args=("job-a", "aaaa"))
    a.start()
    _wait_for(lambda: engine.generating, "job a to generate")
    a_id = next(iter(engine.generating))
    b = threading.Thread(target=run, args=("job-b", "bbbb"))
    b.start()
    # Job b is now either waiting at the gate or (the defect) loaded and waiting.
    _wait_for(lambda: adapters._gate.waiting == 1, "job b to wait for the slot")
    engine.release[a_id].set()
    a.join(30)
    _wait_for(lambda: len(engine.generating) == 2, "job b to generate")
    for event in engine.release.values():
        event.set()
    for lora_id in engine.generating:
        engine.release.setdefault(lora_id, threading.Event()).set()
    b.join(30)
    host._loop.call_soon_threadsafe(host._loop.stop)

    assert not isinstance(results.get("job-a"), BaseException), results
    assert not isinstance(results.get("job-b"), BaseException), results
    assert [lora_id for lora_id, _ in engine.loads] == [a_id, a_id + 1]
    for lora_id, holding in engine.loads:
        assert holding == {lora_id}, (
            f"adapter {lora_id} was loaded while {holding} held the GPU slots"
        )


def test_a_slot_wait_is_measured_once_also_when_it_ended_without_a_slot() -> None:
    """``slot_wait_ms`` counts from the request for a slot to the first end of that wait:
    the slot given, or (``_generate_by_deadline``'s ``finally``) the deadline or a
    cancellation; a job that never asked has none."""
    from worker.runner import EngineEntry

    never = EngineEntry(time.time())
    never.slot_wait_over()
    assert never.slot_wait_ms is None

    entry = EngineEntry(time.time())
    entry.asking_for_slot()
    time.sleep(0.02)
    entry.slot_wait_over()
    waited = entry.slot_wait_ms
    assert waited is not None and waited >= 20
    time.sleep(0.02)
    entry.slot_wait_over()  # the finally after a wait that ended with the slot
    assert entry.slot_wait_ms == waited
