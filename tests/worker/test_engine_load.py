"""Who an engine death during ``add_lora`` counts against (pure logic: the engine host is a
stand-in that succeeds, dies, or is already dead).

A job whose adapter's load kills the engine must be charged with that death, as a prompt
that kills it would be, or an adapter that kills every engine it is loaded into would crash
worker after worker until its deadline; a job that merely finds the engine dead is not.
"""

from __future__ import annotations

import asyncio

import pytest
from vllm.lora.request import LoRARequest
from vllm.v1.engine.exceptions import EngineDeadError

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


def _load(host: Host, running: Running | None) -> None:
    adapters = EngineAdapters(host, cache=None, max_loras=2)  # type: ignore[arg-type]
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
