"""One vLLM ``AsyncLLM`` per worker process, driven from an event loop on its own thread.

Celery's thread pool runs many tasks at once; each submits coroutines to this loop, so the
engine sees all of them together and batches across jobs and adapters.

The host also knows when its engine can no longer run anything: vLLM reports a dead engine
core (``EngineDeadError``, ``errored``), and ``probe`` bounds a round trip through the loop
and the engine core, which catches a wedged loop or a hung engine core. Once failed
(``fail``), every call waiting on the engine ends at once with ``EngineFailed`` and new calls
are refused; the worker then hands its jobs back and exits (``worker.runtime``).
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import logging
import os
import threading
import time
from collections.abc import Callable, Coroutine
from concurrent.futures import CancelledError, Future
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal, TypeVar

import psutil
import vllm
from vllm.engine.arg_utils import AsyncEngineArgs
from vllm.usage.usage_lib import UsageContext
from vllm.v1.engine.async_llm import AsyncLLM
from vllm.v1.engine.exceptions import EngineDeadError
from vllm.v1.metrics.loggers import StatLoggerBase

from worker.config import LoraRank, WorkerSettings

T = TypeVar("T")

_PROBE_LOOK_S = 0.5
"""While a probe waits, how often it looks whether the core exited or the watch is closing."""


def _engine_processes_seen(stopping: threading.Event | None, window_s: float = 1.0) -> str:
    """For the log of a probe that timed out: each process under this one (vLLM's engine core
    and model workers) with its state and the share of a core it used over ``window_s`` (cut
    short if ``stopping`` is set), and the host's CPU, memory and IO pressure (PSI, first
    line). Tells a busy engine on a starved or thrashing host from one that is stopped or
    waits on nothing."""
    parts = []
    try:
        children = psutil.Process().children(recursive=True)
        before = {}
        for child in children:
            with contextlib.suppress(psutil.Error):
                before[child.pid] = sum(child.cpu_times()[:2])
        started = time.monotonic()
        if stopping is None:
            time.sleep(window_s)
        else:
            stopping.wait(window_s)
        window_s = max(time.monotonic() - started, 1e-3)
        for child in children:
            if child.pid not in before:
                continue
            with contextlib.suppress(psutil.Error):
                used = sum(child.cpu_times()[:2]) - before[child.pid]
                parts.append(
                    f"{child.name()} {child.pid} {child.status()} "
                    f"{100 * used / window_s:.0f}% of a core"
                )
    except psutil.Error as exc:
        parts.append(f"processes unreadable ({exc})")
    if not parts:
        parts.append("no engine process found")
    for resource in ("cpu", "memory", "io"):
        try:
            first = Path(f"/proc/pressure/{resource}").read_text().split("\n", 1)[0]
        except OSError:
            continue
        parts.append(f"{resource} pressure {first}")
    return "; ".join(parts)


log = logging.getLogger(__name__)


class EngineFailed(Exception):
    """The engine can no longer run anything (its core died, or it stopped answering)."""


@dataclass(frozen=True)
class EngineOptions:
    """The subset of settings that shapes the engine."""

    model: str
    dtype: str
    max_model_len: int | None
    max_loras: int
    max_cpu_loras: int
    max_lora_rank: LoraRank
    max_num_seqs: int | None
    max_num_batched_tokens: int | None
    gpu_memory_utilization: float
    enforce_eager: bool

    @classmethod
    def from_settings(cls, settings: WorkerSettings) -> EngineOptions:
        return cls(
            model=settings.model,
            dtype=settings.dtype,
            max_model_len=settings.max_model_len,
            max_loras=settings.max_loras,
            max_cpu_loras=settings.max_cpu_loras,
            max_lora_rank=settings.lora_rank,
            max_num_seqs=settings.max_num_seqs,
            max_num_batched_tokens=settings.max_num_batched_tokens,
            gpu_memory_utilization=settings.gpu_memory_utilization,
            enforce_eager=settings.enforce_eager,
        )

    def engine_args(self) -> AsyncEngineArgs:
        optional = {
            name: value
            for name, value in (
                ("max_model_len", self.max_model_len),
                ("max_num_seqs", self.max_num_seqs),
                ("max_num_batched_tokens", self.max_num_batched_tokens),
            )
            if value is not None
        }
        return AsyncEngineArgs(
            model=self.model,
            dtype=self.dtype,  # type: ignore[arg-type]
            enable_lora=True,
            max_loras=self.max_loras,
            max_cpu_loras=self.max_cpu_loras,
            max_lora_rank=self.max_lora_rank,
            gpu_memory_utilization=self.gpu_memory_utilization,
            enforce_eager=self.enforce_eager,
            **optional,  # type: ignore[arg-type]
        )


def colocate_children(parent: psutil.Process) -> set[int] | None:
    """Bind all of ``parent``'s descendants, every thread, to the narrowest CPU set among them."""
    children = parent.children(recursive=True)
    allowed = set(os.sched_getaffinity(0))
    narrowest: set[int] | None = None
    for child in children:
        with contextlib.suppress(psutil.Error):
            cores = set(child.cpu_affinity())
            if cores < allowed and (narrowest is None or len(cores) < len(narrowest)):
                narrowest = cores
    if narrowest is None:
        return None
    for child in children:
        with contextlib.suppress(psutil.Error, OSError):
            for thread in child.threads():
                os.sched_setaffinity(thread.id, narrowest)
    return narrowest


ENGINE_NAME = "vllm"
ENGINE_VERSION = vllm.__version__


class _Progress(StatLoggerBase):
    """vLLM calls ``record`` on the engine loop for every batch of outputs the engine core
    returns (a step): the watchdog's evidence that the engine works, for streamed jobs and
    for jobs that see only their final output alike."""

    def __init__(self, vllm_config: Any, engine_index: int = 0, *, host: EngineHost) -> None:
        self._host = host

    def record(
        self,
        scheduler_stats: Any,
        iteration_stats: Any,
        mm_cache_stats: Any = None,
        engine_idx: int = 0,
    ) -> None:
        if iteration_stats is not None:  # the step returned outputs
            self._host.progressed()

    def log_engine_initialized(self) -> None:
        return None


class EngineHost:
    """Owns the event-loop thread and the engine on it; thread-safe ``run`` for callers."""

    def __init__(self, options: EngineOptions) -> None:
        self._options = options
        self._loop = asyncio.new_event_loop()
        self._thread = threading.Thread(
            target=self._loop.run_forever, name="engine-loop", daemon=True
        )
        self._engine: AsyncLLM | None = None
        self._lock = threading.Lock()
        self._pending: set[Future[Any]] = set()
        self._failure: str | None = None
        self._on_failure: list[Callable[[str], None]] = []
        self._output_at = -float("inf")  # monotonic: the last engine step with outputs

    def start(self) -> None:
        """Start the loop thread and build the engine on it (blocks until ready)."""
        self._thread.start()
        self._engine = self.run(self._build())

    async def _build(self) -> AsyncLLM:
        # As a server, not as vLLM's library engine: unset batch limits then take the values
        # `vllm serve` would on this hardware (the library context's fall back to 128 / 2048).
        return AsyncLLM.from_engine_args(
            self._options.engine_args(),
            usage_context=UsageContext.OPENAI_API_SERVER,
            stat_loggers=[functools.partial(_Progress, host=self)],
        )

    @property
    def engine(self) -> AsyncLLM:
        if self._engine is None:
            raise RuntimeError("the engine has not been started")
        return self._engine

    @property
    def batch_limits(self) -> dict[str, int]:
        """The scheduler's limits the engine actually took (defaults resolved)."""
        scheduler = self.engine.vllm_config.scheduler_config
        return {
            "max_num_seqs": scheduler.max_num_seqs,
            "max_num_batched_tokens": scheduler.max_num_batched_tokens,
        }

    def colocate_engine_core(self) -> set[int] | None:
        """Bind every engine process to the narrowest CPU set any of them is bound to.

        On CPUs vLLM binds its model worker's OpenMP threads to some cores and reserves the
        rest for the frontend, but leaves its engine-core process unbound; that process
        busy-polls between steps, on the reserved cores too, starving this process's consumer
        and job threads. Returns the cores applied (``None``: nothing was narrower).
        """
        return colocate_children(psutil.Process())

    @property
    def failure(self) -> str | None:
        """Why the engine failed (``None`` while it serves)."""
        return self._failure

    def on_failure(self, callback: Callable[[str], None]) -> None:
        """Call ``callback(reason)`` once, from whichever thread notices the failure first."""
        self._on_failure.append(callback)

    def fail(self, reason: str) -> None:
        """Mark the engine failed (first reason wins): every pending call ends with
        ``EngineFailed``, later ones are refused, and the failure callbacks run."""
        with self._lock:
            if self._failure is not None:
                return
            self._failure = reason
            pending, self._pending = self._pending, set()
        log.critical("engine failed: %s", reason)
        for future in pending:
            future.cancel()
        for callback in self._on_failure:
            callback(reason)

    def _refuse_if_failed(self) -> None:
        if self._failure is not None:
            raise EngineFailed(self._failure)

    def check_serving(self) -> None:
        """Raise ``EngineFailed`` unless the engine still serves, as far as anyone can tell:
        not failed here, and not reported dead by vLLM (whose monitor may know first)."""
        if self._failure is None and self._engine is not None and self._engine.errored:
            self.fail("the engine core process exited")
        self._refuse_if_failed()

    def died(self, error: EngineDeadError) -> EngineFailed:
        """Fail the engine for ``error`` (vLLM's own): call where it surfaces, so that the
        failure is recorded before anything else on the loop runs."""
        self.fail(f"the engine core died ({error})")
        return EngineFailed(self._failure or str(error))

    async def _guarded(self, coro: Coroutine[Any, Any, T]) -> T:
        # A failure cancels the caller's future first; vLLM's cancelled ``generate`` then
        # aborts on a dead engine and this task ends with an error its future no longer
        # takes. Read here, it is not logged as "never retrieved" once per running job; the
        # caller learns of the failure from ``result``. (Other errors nobody takes are still
        # logged so.)
        task = asyncio.current_task()
        if task is not None:
            task.add_done_callback(self._read_if_failed)
        try:
            return await coro
        except EngineDeadError as exc:
            raise self.died(exc) from exc

    def _read_if_failed(self, task: asyncio.Task[Any]) -> None:
        if self._failure is not None and not task.cancelled():
            task.exception()

    def submit(self, coro: Coroutine[Any, Any, T]) -> Future[T]:
        """Schedule ``coro`` on the engine loop from any thread. The future is cancelled if the
        engine fails meanwhile; an ``EngineDeadError`` inside it fails the engine."""
        with self._lock:
            if self._failure is not None:
                coro.close()
                raise EngineFailed(self._failure)
            future = asyncio.run_coroutine_threadsafe(self._guarded(coro), self._loop)
            self._pending.add(future)
        future.add_done_callback(self._forget)
        return future

    def _forget(self, future: Future[Any]) -> None:
        with self._lock:
            self._pending.discard(future)

    def result(self, future: Future[T], timeout_s: float | None = None) -> T:
        """Wait for ``future`` (from ``submit``); ``EngineFailed`` if the engine failed."""
        try:
            return future.result(timeout=timeout_s)
        except CancelledError:
            self._refuse_if_failed()
            raise

    def run(self, coro: Coroutine[Any, Any, T], timeout_s: float | None = None) -> T:
        """Run ``coro`` on the engine loop and wait for its result; past ``timeout_s`` the
        coroutine is cancelled and ``TimeoutError`` raised. ``EngineFailed`` once the engine
        failed, also while waiting."""
        future = self.submit(coro)
        try:
            return self.result(future, timeout_s)
        except TimeoutError:
            future.cancel()
            raise

    def probe(self, timeout_s: float, stopping: threading.Event | None = None) -> None:
        """One round trip through the loop and the engine core (served between engine steps),
        within ``timeout_s``; fails the engine if it is dead, or if it does not answer in time
        and returned no step's outputs in the last half of that time (outputs still flowing
        mean it is busy, not wedged). While it waits, a core that vLLM reports exited fails
        the engine at once, and ``stopping`` (the watch closing: the worker shuts down and
        stops the engine itself) ends the wait with no verdict.

        The question is one the engine core answers itself (``is_sleeping``), not one it asks
        its model workers (``list_loras`` did): a worker woken by a request busy-polls its
        shared-memory queue for a second before it sleeps again, so a probe every 5 s through
        the workers kept an idle engine's worker process at ~24% of a core (95% probed every
        second), on a GPU worker as here."""

        async def ask() -> None:
            await self.engine.check_health()
            await self.engine.is_sleeping()

        if self.engine.errored:
            self.fail("the engine core process exited")
        answer = self.submit(ask())
        waited = self._await_answer(answer, timeout_s, stopping)
        if waited == "timed out":
            quiet_s = time.monotonic() - self._output_at
            try:
                seen = _engine_processes_seen(stopping)
            except Exception as exc:  # a diagnostic: it must not keep the verdict from coming
                seen = f"engine processes not read ({exc!r})"
            if quiet_s < timeout_s / 2:
                # Steps still return outputs: the loop and the core are working, the core
                # only answered slowly (an overloaded host: CI saw it once with several
                # engines bound to one core). A wedged engine produces nothing, and is failed
                # by the first probe that times out half a timeout after its last output.
                log.warning(
                    "the engine did not answer a health probe within %g s, but its last "
                    "output came %.1f s ago: busy, not wedged (%s)",
                    timeout_s,
                    quiet_s,
                    seen,
                )
                return
            log.error("engine probe unanswered; last output %.1f s ago; %s", quiet_s, seen)
            self.fail(
                f"the engine did not answer a health probe within {timeout_s:g} s (its event "
                "loop or its engine core is stuck)"
            )
        self._refuse_if_failed()

    def _await_answer(
        self, answer: Future[None], timeout_s: float, stopping: threading.Event | None
    ) -> Literal["answered", "timed out", "stopped"]:
        """Wait for a probe's ``answer``: "answered", "timed out" (cancelled then), or
        "stopped" (``stopping`` was set; cancelled). Looks every ``_PROBE_LOOK_S`` whether
        vLLM reports the core exited, and fails the engine then (``EngineFailed``)."""
        deadline = time.monotonic() + timeout_s
        while True:
            try:
                self.result(answer, min(_PROBE_LOOK_S, max(deadline - time.monotonic(), 0)))
            except TimeoutError:
                pass
            else:
                return "answered"
            if self._engine is not None and self._engine.errored:
                answer.cancel()
                self.fail("the engine core process exited")
                self._refuse_if_failed()
            if stopping is not None and stopping.is_set():
                answer.cancel()
                return "stopped"
            if time.monotonic() >= deadline and not answer.done():
                answer.cancel()
                return "timed out"

    def progressed(self) -> None:
        """The engine returned outputs of a step (``_Progress``, on the engine loop)."""
        self._output_at = time.monotonic()

    def unfinished_requests(self, timeout_s: float = 5.0) -> int:
        """Requests the engine still holds (running or waiting), asked on its own loop."""

        async def count() -> int:
            return self.engine.get_num_unfinished_requests()

        return self.run(count(), timeout_s)

    def shutdown(self) -> None:
        """Stop the engine (and its child processes), then the loop thread."""
        if self._engine is not None:
            self._engine.shutdown()
            self._engine = None
        if self._thread.is_alive():
            self._loop.call_soon_threadsafe(self._loop.stop)
            # A wedged loop never stops: the thread is a daemon and the process leaves anyway.
            self._thread.join(timeout=10)
