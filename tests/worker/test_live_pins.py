"""Pinning and unpinning while jobs run never takes a GPU slot a generating job holds.

Pure logic: the real ``JobRunner``, ``EngineAdapters``, ``SlotGate`` and ``EngineHost`` loop
around the engine stand-in of ``test_slot_order`` (it records which adapters held slots at
each load), which also records pins and removals here.
"""

from __future__ import annotations

import asyncio
import threading
from typing import Any

import pytest

from tests.worker.test_slot_order import BASE, Cache, Deltas, Engine, _message, _wait_for
from worker.engine import EngineHost
from worker.inflight import Running
from worker.residency import EngineAdapters
from worker.runner import JobRunner


class PinningEngine(Engine):
    def __init__(self, adapters: list[EngineAdapters]) -> None:
        super().__init__(adapters)
        self.pinned: list[tuple[int, set[int]]] = []  # (adapter id, ids holding slots then)
        self.removed: list[int] = []

    pin_takes_s = 0.0
    pin_held: threading.Event | None = None  # set: the engine's pin may end

    async def pin_lora(self, lora_id: int) -> bool:
        self.pinned.append((lora_id, set(self._adapters[0]._gate._active)))
        await asyncio.sleep(self.pin_takes_s)
        while self.pin_held is not None and not self.pin_held.is_set():
            await asyncio.sleep(0.01)
        return True

    async def remove_lora(self, lora_id: int) -> bool:
        self.removed.append(lora_id)
        self.registered.discard(lora_id)
        return True


def _digest(name: str) -> str:
    return "sha256:" + name.rjust(64, "0")


@pytest.fixture
def harness(request: pytest.FixtureRequest) -> Any:
    """The engine and ``max_loras`` (the test's ``indirect`` parameter) GPU adapter slots."""
    host = EngineHost(options=None)  # type: ignore[arg-type]
    holder: list[EngineAdapters] = []
    engine = PinningEngine(holder)
    host._thread.start()
    host._engine = engine  # type: ignore[assignment]
    adapters = EngineAdapters(host, Cache(), max_loras=request.param)  # type: ignore[arg-type]
    holder.append(adapters)
    runner = JobRunner(host, Cache(), adapters, BASE, "w", Deltas())  # type: ignore[arg-type]
    results: dict[str, Any] = {}
    threads: list[threading.Thread] = []

    def start(job_id: str, adapter: str) -> int:
        def run() -> None:
            try:
                results[job_id] = runner.run(_message(job_id, adapter), Running(job_id, 1))
            except BaseException as exc:  # reported by the assertions
                results[job_id] = exc

        thread = threading.Thread(target=run)
        thread.start()
        threads.append(thread)
        return adapters.request_for(adapter, _digest(adapter)).lora_int_id

    def release(lora_id: int) -> None:
        engine.release.setdefault(lora_id, threading.Event()).set()

    yield adapters, engine, start, release, results
    for event in engine.release.values():
        event.set()
    for lora_id in list(engine.generating):
        release(lora_id)
    for thread in threads:
        thread.join(30)
    host._loop.call_soon_threadsafe(host._loop.stop)


@pytest.mark.parametrize("harness", [2], indirect=True)
def test_a_live_pin_waits_for_a_free_slot_and_an_unpin_for_the_jobs_on_it(harness: Any) -> None:
    adapters, engine, start, release, results = harness
    a, b = start("job-a", "aaaa"), start("job-b", "bbbb")
    _wait_for(lambda: {a, b} <= engine.generating.keys(), "jobs a and b to generate")
    # Both GPU slots hold generating jobs' adapters: the pin waits its turn, loads nothing.
    pinned: dict[str, Any] = {}
    pinning = threading.Thread(
        target=lambda: pinned.update(r=adapters.pin_live("pppp", _digest("pppp"), 30))
    )
    pinning.start()
    _wait_for(lambda: adapters._gate.waiting == 1, "the pin to wait for a slot")
    p = adapters.request_for("pppp", _digest("pppp")).lora_int_id
    assert p not in {lora_id for lora_id, _ in engine.loads}
    release(a)  # job a ends: its slot is the pin's
    pinning.join(30)
    assert pinned["r"].request.lora_int_id == p
    assert engine.pinned == [(p, {b, p})]  # loaded and pinned in a slot of its own
    assert adapters.pinned_digests == {_digest("pppp")}
    # One slot pinned, one for every other adapter: job c waits until job b has left.
    c = start("job-c", "cccc")
    _wait_for(lambda: adapters._gate.waiting == 1, "job c to wait for the one unpinned slot")
    # A job of the pinned adapter runs at once, beside b, without a gate slot.
    start("job-p", "pppp")
    _wait_for(lambda: p in engine.generating, "the pinned adapter's job to generate")
    assert adapters._gate.waiting == 1
    # Unpinned while its job generates: nothing is removed until that job has ended.
    unpinned: dict[str, Any] = {}
    unpinning = threading.Thread(target=lambda: unpinned.update(r=adapters.unpin(_digest("pppp"))))
    unpinning.start()
    _wait_for(lambda: not adapters.pinned_digests, "the adapter to count as unpinned")
    assert engine.removed == [] and unpinning.is_alive()
    release(p)
    unpinning.join(30)
    assert unpinned["r"] is True and engine.removed == [p]
    # Its slot is the gate's again: job c gets the second slot beside b.
    _wait_for(lambda: c in engine.generating, "job c to generate")
    assert adapters.unpin(_digest("pppp")) is False  # not pinned: nothing to do
    release(b)
    release(c)
    for job_id in ("job-a", "job-b", "job-c", "job-p"):
        _wait_for(lambda job_id=job_id: job_id in results, f"{job_id} to end")
        assert not isinstance(results[job_id], BaseException), results[job_id]
    # Every load happened with only its own adapter holding a slot beyond the generating ones.
    for lora_id, holding in engine.loads:
        assert lora_id in holding, (lora_id, holding)
        assert len(holding) <= 2, (lora_id, holding)


@pytest.mark.parametrize("harness", [3], indirect=True)
def test_a_pin_given_up_while_the_engine_pins_keeps_its_slot_until_counted(harness: Any) -> None:
    """A live pin whose wait ends (timeout) while the engine pins: the slot it took at the
    gate is not let go before the pin is counted, so no job's adapter gets in on a slot the
    engine has given to the pin; the pin stands and is counted."""
    adapters, engine, start, release, results = harness
    a, b = start("job-a", "aaaa"), start("job-b", "bbbb")
    _wait_for(lambda: {a, b} <= engine.generating.keys(), "jobs a and b to generate")
    engine.pin_held = threading.Event()
    with pytest.raises(TimeoutError):
        adapters.pin_live("pppp", _digest("pppp"), 0.3)
    # Given up, the pin goes on; a job of a third adapter arrives meanwhile and waits.
    c = start("job-c", "cccc")
    _wait_for(lambda: adapters._gate.waiting == 1, "job c to wait at the gate")
    engine.pin_held.set()
    _wait_for(lambda: adapters.pinned_digests == {_digest("pppp")}, "the engine's pin to end")
    # 3 slots: 1 pinned, 2 held by a and b: c waits (before the fix it was let in as the
    # pin's slot was released, and 4 adapters then needed 3 slots).
    assert c not in engine.generating and adapters._gate.waiting == 1
    release(a)
    _wait_for(lambda: c in engine.generating, "job c to take a's slot")
    for lora_id in (b, c):
        release(lora_id)
    for job_id in ("job-a", "job-b", "job-c"):
        _wait_for(lambda job_id=job_id: job_id in results, f"{job_id} to end")
        assert not isinstance(results[job_id], BaseException), results[job_id]
