"""The watchdog's probe, and what an engine failure leaves behind, on a real ``EngineHost``
loop with a stand-in engine core (pure logic: a real core cannot be made to answer slowly
while it streams, or to die between two awaits, on demand).

An engine that does not answer a probe in time is wedged only if no engine step returned
outputs in the last half of that time: CI once saw a loaded engine (several engines bound to
one core) fail its probe while its jobs were generating, and the worker's exit cost those
jobs an attempt each.
"""

from __future__ import annotations

import asyncio
import functools
import gc
import threading
from collections.abc import Iterator
from typing import Any

import pytest
from vllm.v1.engine.exceptions import EngineDeadError

from worker.engine import EngineFailed, EngineHost, EngineOptions

PROBE_S = 2.0
"""Long beside the 50 ms between outputs, so a loaded machine's scheduling jitter does not
matter."""


class SlowCore:
    """Answers ``is_sleeping`` never (a wedged or an overloaded core); reports itself alive."""

    errored = False

    async def check_health(self) -> None:
        return None

    async def is_sleeping(self) -> bool:
        await asyncio.sleep(3600)
        return False

    def shutdown(self) -> None:
        return None


@pytest.fixture
def host() -> Iterator[EngineHost]:
    options = EngineOptions(
        model="stand-in",
        dtype="float32",
        max_model_len=None,
        max_loras=1,
        max_cpu_loras=1,
        max_lora_rank=8,
        max_num_seqs=None,
        max_num_batched_tokens=None,
        gpu_memory_utilization=0.3,
        enforce_eager=True,
    )
    engine_host = EngineHost(options)
    engine_host._thread.start()
    engine_host._engine = SlowCore()  # type: ignore[assignment]
    yield engine_host
    engine_host.shutdown()


def test_a_probe_unanswered_while_no_step_returns_outputs_fails_the_engine(
    host: EngineHost, caplog: pytest.LogCaptureFixture
) -> None:
    with pytest.raises(EngineFailed, match="did not answer a health probe"):
        host.probe(PROBE_S)
    assert host.failure is not None
    # What the engine's processes and the host were doing is logged with the verdict.
    assert any("engine probe unanswered" in r.getMessage() for r in caplog.records)


def test_a_probe_whose_diagnostic_breaks_still_fails_a_wedged_engine(
    host: EngineHost, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The processes and pressure read for the log are a diagnostic: whatever goes wrong in
    it (an unreadable ``/proc`` file, say) must not keep the verdict from being given."""

    def broken(*args: Any) -> str:
        raise UnicodeDecodeError("utf-8", b"\xff", 0, 1, "invalid start byte")

    monkeypatch.setattr("worker.engine._engine_processes_seen", broken)
    with pytest.raises(EngineFailed, match="did not answer a health probe"):
        host.probe(PROBE_S)
    assert host.failure is not None


def test_a_probe_unanswered_while_steps_return_outputs_leaves_the_engine_serving(
    host: EngineHost,
) -> None:
    """Outputs every 50 ms (the engine's steps, as ``_Progress`` records them), the last one
    just before the probe gives up: a probe that times out meanwhile is excused. Once they stop
    (the core hung mid-step), the next probe that times out fails the engine."""
    stop = threading.Event()

    def steps() -> None:
        while not stop.wait(0.05):
            host.progressed()

    unanswered = host._await_answer

    def a_step_at_the_end(*args: Any) -> str:
        waited = unanswered(*args)
        if waited == "timed out":
            # A step returned outputs as the probe timed out, however late the stepping thread
            # was scheduled on a busy machine (it used to need one within the last second).
            host.progressed()
        return waited

    stepping = threading.Thread(target=steps)
    stepping.start()
    host._await_answer = a_step_at_the_end  # type: ignore[method-assign]
    try:
        host.probe(PROBE_S)  # slow, but outputs flow: busy, not wedged
    finally:
        host._await_answer = unanswered  # type: ignore[method-assign]
        stop.set()
        stepping.join()
    assert host.failure is None
    with pytest.raises(EngineFailed):
        host.probe(PROBE_S)
    assert host.failure is not None


def test_jobs_stopped_by_an_engine_failure_leave_no_unretrieved_task_exception(
    host: EngineHost,
) -> None:
    """An engine failure cancels every pending job's future; vLLM's ``generate``, cancelled,
    aborts its request, which on a dead engine raises ``EngineDeadError``: each such task
    then ended with an exception nobody would read, and asyncio logged "Task exception was
    never retrieved" for every job running (seen in the soak after an engine-core kill).
    Every caller still gets ``EngineFailed``."""
    reported: list[str] = []
    host._loop.call_soon_threadsafe(
        host._loop.set_exception_handler,
        lambda loop, context: reported.append(str(context.get("message"))),
    )
    started = threading.Semaphore(0)

    async def generate() -> None:  # as vLLM's: a cancelled request is aborted
        try:
            started.release()
            await asyncio.sleep(3600)
        except asyncio.CancelledError:
            raise EngineDeadError() from None

    futures = [host.submit(generate()) for _ in range(4)]
    for _ in futures:
        assert started.acquire(timeout=30)
    host.fail("the engine core process exited")
    for future in futures:
        with pytest.raises(EngineFailed):
            host.result(future, timeout_s=30)
    del futures, future
    # Collected here or on the loop's thread: ask both, then read what the loop reported.
    gc.collect()
    collected = threading.Event()
    host._loop.call_soon_threadsafe(lambda: (gc.collect(), collected.set()))
    assert collected.wait(10)
    assert not [m for m in reported if "never retrieved" in m], reported


def test_the_progress_logger_is_called_as_vllm_calls_its_stat_loggers() -> None:
    """``_Progress`` built and called through vLLM's own adapter for per-engine loggers, the
    way ``AsyncLLM`` records a step (keywords, as its output handler passes them): a step
    with outputs is progress, one without is not."""
    from vllm.v1.metrics.loggers import PerEngineStatLoggerAdapter

    from worker.engine import _Progress

    class Host:
        steps = 0

        def progressed(self) -> None:
            self.steps += 1

    host = Host()
    adapter = PerEngineStatLoggerAdapter(
        vllm_config=None,  # type: ignore[arg-type]  # _Progress does not read it
        engine_indexes=[0],
        per_engine_stat_logger_factory=functools.partial(_Progress, host=host),  # type: ignore[arg-type]
    )
    adapter.log_engine_initialized()
    adapter.record(scheduler_stats=None, iteration_stats=None, mm_cache_stats=None, engine_idx=0)
    assert host.steps == 0
    adapter.record(
        scheduler_stats=None, iteration_stats=object(), mm_cache_stats=None, engine_idx=0
    )  # type: ignore[arg-type]
    adapter.log()
    assert host.steps == 1


BOUND_S = 30.0
"""How long the tests below wait for a probe that must give up at once; its own timeout is an
hour, so a probe that waits it out fails them."""


def _in_thread(call: Any) -> tuple[threading.Thread, list[BaseException | None]]:
    """Run ``call`` on a thread; the list gets its exception (``None``: it returned)."""
    outcome: list[BaseException | None] = []

    def run() -> None:
        try:
            call()
        except BaseException as exc:  # handed to the test
            outcome.append(exc)
        else:
            outcome.append(None)

    thread = threading.Thread(target=run, daemon=True)
    thread.start()
    return thread, outcome


def _noting_probes(host: EngineHost) -> threading.Event:
    """An event set once a probe reaches the stand-in core (which still never answers)."""
    asked = threading.Event()
    core: Any = host._engine
    original = core.is_sleeping

    async def is_sleeping() -> bool:
        asked.set()
        return bool(await original())

    core.is_sleeping = is_sleeping
    return asked


def test_a_probe_waiting_on_a_core_that_exits_fails_the_engine_without_waiting_it_out(
    host: EngineHost,
) -> None:
    """vLLM reports its core gone (``errored``) while a probe waits for an answer that will
    never come: the probe fails the engine for what it is, a core that exited, and does not
    wait out its timeout (a worker whose core died under it used to sit out the probe's 30 s
    before the watch could see it)."""
    asked = _noting_probes(host)
    thread, outcome = _in_thread(lambda: host.probe(3600))
    assert asked.wait(BOUND_S)
    core: Any = host._engine
    core.errored = True
    thread.join(BOUND_S)
    assert not thread.is_alive(), "the probe waited for its timeout on an engine that exited"
    assert isinstance(outcome[0], EngineFailed)
    assert host.failure == "the engine core process exited"


def test_closing_the_watch_while_a_probe_waits_neither_waits_it_out_nor_fails_the_engine(
    host: EngineHost,
) -> None:
    """A worker shutting down closes its engine watch, then stops the engine. A probe left
    waiting then (the core already stopping with the process group's signal) used to hold
    ``close`` for the probe's whole timeout and end by failing the engine, logged critical,
    in a worker that was only shutting down."""
    from worker.watchdog import EngineWatch

    asked = _noting_probes(host)
    watch = EngineWatch(host, check_s=0.05, probe_s=0.05, probe_timeout_s=3600)
    watch.start()
    assert asked.wait(BOUND_S)
    thread, outcome = _in_thread(watch.close)
    thread.join(BOUND_S)
    assert not thread.is_alive(), "closing the watch waited for the probe's timeout"
    assert outcome == [None]
    assert host.failure is None
