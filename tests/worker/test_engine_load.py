"""Who an engine death during ``add_lora`` counts against (pure logic: the engine host is a
stand-in that succeeds, dies, or is already dead).

A job whose adapter's load kills the engine must be charged with that death, as a prompt
that kills it would be, or an adapter that kills every engine it is loaded into would crash
worker after worker until its deadline; a job that merely finds the engine dead is not.
"""

from __future__ import annotations

import asyncio
from collections import Counter
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import pytest
from vllm.lora.request import LoRARequest
from vllm.v1.engine.exceptions import EngineDeadError

from contracts.jobs import LoadTimings
from worker.engine import EngineFailed
from worker.inflight import Running
from worker.residency import EngineAdapters


class Engine:
    """``add_lora`` that succeeds, or dies as vLLM's engine does (``EngineDeadError``)."""

    def __init__(self, host: Host) -> None:
        self._host = host

    async def add_lora(self, request: LoRARequest) -> bool:
        self._host.loads += 1
        if self._host.dies_loading:
            raise EngineDeadError()
        return True


class Host:
    """``check_serving`` and ``died`` as ``EngineHost``'s; the engine is a stand-in."""

    def __init__(self, dead_before: bool = False, dies_loading: bool = False) -> None:
        self.engine = Engine(self)
        self.dead_before = dead_before
        self.dies_loading = dies_loading
        self.loads = 0

    def check_serving(self) -> None:
        if self.dead_before:
            raise EngineFailed("the engine core process exited")

    def died(self, error: EngineDeadError) -> EngineFailed:
        return EngineFailed(f"the engine core died ({error})")


class Cache:
    """``AdapterCache.hold``, counted."""

    def __init__(self) -> None:
        self.holds: Counter[str] = Counter()

    @contextmanager
    def hold(self, digest: str) -> Iterator[None]:
        self.holds[digest] += 1
        try:
            yield
        finally:
            self.holds[digest] -= 1


def _load(host: Host, running: Running | None) -> None:
    adapters = EngineAdapters(host, cache=Cache(), max_loras=2)  # type: ignore[arg-type]
    request = LoRARequest(lora_name="a@1234", lora_int_id=1, lora_path="/nowhere")
    asyncio.run(adapters._load(request, "sha256:1234", running))


def test_a_death_while_loading_a_jobs_adapter_counts_against_that_job() -> None:
    running = Running("job", attempt=1)
    with pytest.raises(EngineFailed):
        _load(Host(dies_loading=True), running)
    assert running.in_engine


def test_a_load_that_succeeds_leaves_the_job_out_of_the_engine_until_it_generates() -> None:
    running = Running("job", attempt=1)
    host = Host()
    _load(host, running)
    assert host.loads == 1
    assert not running.in_engine  # an engine death from now on, before it generates, is not its


def test_a_job_that_finds_the_engine_dead_is_not_charged_with_its_death() -> None:
    running = Running("job", attempt=1)
    host = Host(dead_before=True)
    with pytest.raises(EngineFailed):
        _load(host, running)
    assert (host.loads, running.in_engine) == (0, False)


def test_preloading_at_start_has_no_job_to_charge() -> None:
    with pytest.raises(EngineFailed):
        _load(Host(dies_loading=True), None)


def test_the_files_stay_held_until_the_engine_has_read_them_though_the_caller_gave_up() -> None:
    """A job past its deadline (or a prefetch that timed out) stops waiting for ``add_lora``,
    but the engine core goes on reading the adapter's files: the disk cache must not evict
    them until the engine has answered."""
    host = Host()
    cache = Cache()
    adapters = EngineAdapters(host, cache=cache, max_loras=2)  # type: ignore[arg-type]
    request = LoRARequest(lora_name="a@1234", lora_int_id=1, lora_path="/nowhere")
    digest = "sha256:1234"

    async def scenario() -> tuple[int, int]:
        answered = asyncio.Event()

        async def slow_add_lora(request: LoRARequest) -> bool:
            await answered.wait()
            return True

        host.engine.add_lora = slow_add_lora  # type: ignore[method-assign]
        caller = asyncio.ensure_future(adapters._load(request, digest, None))
        await asyncio.sleep(0.01)
        caller.cancel()
        with pytest.raises(asyncio.CancelledError):
            await caller
        while_reading = cache.holds[digest]
        answered.set()
        for _ in range(3000):  # released from a thread once the engine answered
            await asyncio.sleep(0.01)
            if not cache.holds[digest]:
                break
        return while_reading, cache.holds[digest]

    assert asyncio.run(scenario()) == (1, 0)


class ListingEngine:
    """``add_lora`` and ``list_loras`` over a set of ids."""

    def __init__(self) -> None:
        self.loaded: set[int] = set()
        self.loads = 0

    async def add_lora(self, request: LoRARequest) -> bool:
        self.loads += 1
        self.loaded.add(request.lora_int_id)
        return True

    async def list_loras(self) -> set[int]:
        return set(self.loaded)


class LoopHost:
    """``run`` on an event loop of its own, as ``EngineHost``'s."""

    def __init__(self) -> None:
        self.engine = ListingEngine()

    def run(self, coro: Any, timeout_s: float | None = None) -> Any:
        return asyncio.run(coro)

    def check_serving(self) -> None:
        pass


class PathCache(Cache):
    def path_for(self, digest: str) -> str:
        return f"/cache/{digest}"


def test_a_prefetch_that_a_jobs_load_got_ahead_of_does_not_call_the_adapter_its_own() -> None:
    """The prefetch decided to register the adapter, but a job for it (which joins the
    prefetch's GPU slot) got the load first: the prefetch must not count it as its own, or
    the next job would say ``prefetched: true`` about a load a job did."""
    host = LoopHost()
    adapters = EngineAdapters(host, PathCache(), max_loras=2, max_cpu_loras=4)  # type: ignore[arg-type]
    digest = "sha256:" + "e" * 64
    real_load = adapters.load

    async def a_job_loads_it_first(staged: Any, timings: Any, *args: Any) -> Any:
        await real_load(staged, LoadTimings())  # the job that joined the slot
        return await real_load(staged, timings, *args)

    adapters.load = a_job_loads_it_first  # type: ignore[method-assign]
    marks: list[bool] = []
    assert not adapters.prefetch_into_engine("tail", digest, digest, marks.append)
    assert (marks, host.engine.loads) == ([True, False], 1)


class UseCache(PathCache):
    """``in_use``: on disk (``present``) or held."""

    def __init__(self) -> None:
        super().__init__()
        self.present: set[str] = set()

    def in_use(self, digest: str) -> bool:
        return digest in self.present or self.holds[digest] > 0


def test_what_is_kept_per_digest_is_forgotten_once_the_adapter_left_every_level() -> None:
    """Over weeks of new revisions a worker would otherwise keep an id, a handed digest and a
    load lock for every adapter it ever ran; forgotten ids are never given out again."""
    host, cache = LoopHost(), UseCache()
    adapters = EngineAdapters(host, cache, max_loras=2, max_cpu_loras=4)  # type: ignore[arg-type]
    in_engine, on_disk, held, gone = (f"sha256:{c * 64}" for c in "1234")
    ids = {d: adapters.request_for("a", d).lora_int_id for d in (in_engine, on_disk, held, gone)}
    adapters._handed.update({lora_id: digest for digest, lora_id in ids.items()})
    host.engine.loaded = {ids[in_engine]}
    cache.present = {on_disk}
    with cache.hold(held):
        assert adapters.prune(timeout_s=5) == 1
    assert set(adapters._ids) == {in_engine, on_disk, held}
    assert ids[gone] not in adapters._handed
    again = adapters.request_for("a", gone).lora_int_id
    assert again not in ids.values()  # a new id: the old one may never name another adapter
    assert adapters.prune(timeout_s=5) == 2  # the held one, let go; and the new id, unused
    assert set(adapters._ids) == {in_engine, on_disk}


def test_nothing_is_forgotten_on_an_answer_the_engine_gave_before_a_load() -> None:
    """The engine's set changed while it answered (a load began or ended): the answer may
    lack an adapter it holds now, so this round forgets nothing."""
    host, cache = LoopHost(), UseCache()
    adapters = EngineAdapters(host, cache, max_loras=2, max_cpu_loras=4)  # type: ignore[arg-type]
    gone = "sha256:" + "5" * 64
    adapters.request_for("a", gone)
    asked = adapters.registered

    def answered_then_changed(deadline_at: float | None = None) -> set[int]:
        answer = asked(deadline_at)
        adapters.changing()  # e.g. a prefetch's add_lora of that very adapter
        return answer

    adapters.registered = answered_then_changed  # type: ignore[method-assign]
    assert adapters.prune(timeout_s=5) == 0
    assert gone in adapters._ids
    adapters.registered = asked  # type: ignore[method-assign]
    assert adapters.prune(timeout_s=5) == 1
