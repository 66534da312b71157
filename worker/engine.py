"""One vLLM ``AsyncLLM`` per worker process, driven from an event loop on its own thread.

Celery's thread pool runs many tasks at once; each submits coroutines to this loop, so the
engine sees all of them together and batches across jobs and adapters.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import threading
from collections.abc import Coroutine
from concurrent.futures import Future
from dataclasses import dataclass
from typing import Any, TypeVar

import psutil
import vllm
from vllm.engine.arg_utils import AsyncEngineArgs
from vllm.usage.usage_lib import UsageContext
from vllm.v1.engine.async_llm import AsyncLLM

from worker.config import LoraRank, WorkerSettings

T = TypeVar("T")


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


class EngineHost:
    """Owns the event-loop thread and the engine on it; thread-safe ``run`` for callers."""

    def __init__(self, options: EngineOptions) -> None:
        self._options = options
        self._loop = asyncio.new_event_loop()
        self._thread = threading.Thread(
            target=self._loop.run_forever, name="engine-loop", daemon=True
        )
        self._engine: AsyncLLM | None = None

    def start(self) -> None:
        """Start the loop thread and build the engine on it (blocks until ready)."""
        self._thread.start()
        self._engine = self.run(self._build())

    async def _build(self) -> AsyncLLM:
        # As a server, not as vLLM's library engine: unset batch limits then take the values
        # `vllm serve` would on this hardware (the library context's fall back to 128 / 2048).
        return AsyncLLM.from_engine_args(
            self._options.engine_args(), usage_context=UsageContext.OPENAI_API_SERVER
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

    def submit(self, coro: Coroutine[Any, Any, T]) -> Future[T]:
        """Schedule ``coro`` on the engine loop from any thread."""
        return asyncio.run_coroutine_threadsafe(coro, self._loop)

    def run(self, coro: Coroutine[Any, Any, T], timeout_s: float | None = None) -> T:
        """Run ``coro`` on the engine loop and wait for its result; past ``timeout_s`` the
        coroutine is cancelled and ``TimeoutError`` raised."""
        future = self.submit(coro)
        try:
            return future.result(timeout=timeout_s)
        except TimeoutError:
            future.cancel()
            raise

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
            self._thread.join(timeout=10)
