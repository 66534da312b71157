"""Runs one job on the engine: check the base model, make the adapter resident, generate.

A plain class that knows nothing of Celery; the task module is a thin shell around it.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import contextlib
import threading
import time
import uuid
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass
from typing import Any

from vllm import SamplingParams
from vllm.lora.request import LoRARequest
from vllm.sampling_params import RequestOutputKind
from vllm.v1.engine.exceptions import EngineDeadError

from contracts.errors import ErrorCode
from contracts.jobs import (
    EngineInfo,
    JobMessage,
    JobResult,
    LoadTimings,
    Residency,
    ResultMetadata,
    Sampling,
    Usage,
)
from contracts.registry import BaseModelRef
from worker import metrics
from worker.adapter_cache import AdapterCache
from worker.engine import ENGINE_NAME, ENGINE_VERSION, EngineFailed, EngineHost
from worker.errors import (
    AdapterIntegrityError,
    JobFailure,
    JobStopped,
    StopReason,
    StoreUnreachable,
)
from worker.inflight import Running
from worker.residency import EngineAdapters, Staged
from worker.streams import DeltaPublisher, StreamFenced

STREAM_FLUSH_S = 60.0
"""How long a finished streaming job waits for Redis to take the rest of its text."""


@dataclass(frozen=True)
class Generation:
    result: JobResult
    ttft_ms: float | None
    loaded_digest: str


@dataclass
class EngineEntry:
    """When a job got to the engine, measured on the worker (None: it did not get there)."""

    started: float
    """``time.time()`` at the job's start on this worker."""
    slot_wait_ms: float | None = None
    to_engine_ms: float | None = None
    _asked: float | None = None

    def asking_for_slot(self) -> None:
        self._asked = time.perf_counter()

    def slot_wait_over(self) -> None:
        """The slot was given, or the wait ended without it (deadline, cancellation): the
        first call after ``asking_for_slot`` counts."""
        if self._asked is not None and self.slot_wait_ms is None:
            self.slot_wait_ms = round((time.perf_counter() - self._asked) * 1000, 3)

    def arrived(self) -> None:
        self.to_engine_ms = round((time.time() - self.started) * 1000, 3)


def _check_deadline(message: JobMessage, doing: str) -> None:
    if time.time() >= message.deadline_at:
        raise JobFailure(
            ErrorCode.DEADLINE_EXCEEDED,
            f"The job {doing} past its deadline and was not run.",
        )


def _sampling_params(sampling: Sampling, stream: bool) -> SamplingParams:
    return SamplingParams(
        max_tokens=sampling.max_tokens,
        min_tokens=sampling.min_tokens,
        temperature=sampling.temperature,
        top_p=sampling.top_p,
        top_k=sampling.top_k,
        min_p=sampling.min_p,
        presence_penalty=sampling.presence_penalty,
        frequency_penalty=sampling.frequency_penalty,
        repetition_penalty=sampling.repetition_penalty,
        seed=sampling.seed,
        stop=sampling.stop or None,
        ignore_eos=sampling.ignore_eos,
        # One output per request unless the caller streams: per-token deltas cost Python
        # time on every engine step.
        output_kind=RequestOutputKind.DELTA if stream else RequestOutputKind.FINAL_ONLY,
    )


class JobRunner:
    """Turns a ``JobMessage`` into a result plus observed metadata, or raises ``JobFailure``.

    A failure carries the metadata observed up to the point of failure (``metadata``). A job
    stopped through its ``Running`` handle (cancelled, given back by a draining worker, its
    lease lost) raises ``JobStopped`` at the next step, or at once if it is generating; so
    does every job once the engine failed (``StopReason.ENGINE_FAILED``).

    A job on its last chance (the engine died under it as often as it may, but once) runs
    alone among such jobs: if it is the one that kills engines it is stopped by the next
    death, and no other job that happened to share a batch with it twice is stopped with it.
    """

    def __init__(
        self,
        host: EngineHost,
        cache: AdapterCache,
        adapters: EngineAdapters,
        base_model: BaseModelRef,
        hostname: str,
        deltas: DeltaPublisher,
        prefetched: Callable[[str, Residency], bool] = lambda digest, residency: False,
        counted_ahead: Callable[[str], bool] = lambda job_id: False,
    ) -> None:
        self._prefetched = prefetched
        """Whether a prefetch brought a digest to the level a job found it at."""
        self._counted_ahead = counted_ahead
        """Whether the look-ahead counted a job in its adapter's request rate already."""
        self._host = host
        self._deltas = deltas
        self._cache = cache
        self._adapters = adapters
        self._base_model = base_model
        self._hostname = hostname
        self._aborts = 0
        self._aborts_lock = threading.Lock()
        self._last_chance = asyncio.Lock()

    @property
    def aborted_requests(self) -> int:
        """Engine requests this runner aborted (cancelled, past deadline, handed back)."""
        with self._aborts_lock:
            return self._aborts

    def _aborted(self) -> None:
        with self._aborts_lock:
            self._aborts += 1

    def run(
        self, message: JobMessage, running: Running, last_chance: bool = False
    ) -> tuple[JobResult, ResultMetadata]:
        started = time.time()
        entry = EngineEntry(started)
        timings = LoadTimings()
        residency: Residency = "unknown"
        prefetched = False
        try:
            running.check()
            _check_deadline(message, "waited in the queue")
            if message.base_model.digest != self._base_model.digest:
                raise JobFailure(
                    ErrorCode.BASE_MODEL_MISMATCH,
                    f"Adapter {message.adapter} targets base model {message.base_model.digest}, "
                    f"but this worker serves {self._base_model.digest}.",
                )
            with self._cache.hold(message.revision):
                registered = self._adapters.registered(message.deadline_at)
                metrics.RESIDENT.labels("cpu").set(len(registered))
                residency = self._adapters.observe(message.revision, registered)
                prefetched = self._prefetched(message.revision, residency)
                staged = self._adapters.stage(
                    message.adapter,
                    message.revision,
                    timings,
                    message.deadline_at,
                    running,
                    count=not self._counted_ahead(message.job_id),
                )
                running.check()
                _check_deadline(message, "waited for its adapter")
                generation = self._generate_unless_stopped(
                    message, staged, timings, entry, running, last_chance
                )
        except EngineFailed:
            raise JobStopped(StopReason.ENGINE_FAILED) from None
        except JobFailure as failure:
            failure.metadata = self._metadata(
                message, entry, residency, timings, None, None, prefetched
            )
            raise
        metadata = self._metadata(
            message,
            entry,
            residency,
            timings,
            generation.loaded_digest,
            generation.ttft_ms,
            prefetched,
        )
        return generation.result, metadata

    def _metadata(
        self,
        message: JobMessage,
        entry: EngineEntry,
        residency: Residency,
        timings: LoadTimings,
        loaded_digest: str | None,
        ttft_ms: float | None,
        prefetched: bool,
    ) -> ResultMetadata:
        return ResultMetadata(
            adapter=message.adapter,
            revision=message.revision,
            loaded_digest=loaded_digest,
            identity_verified=loaded_digest == message.revision,
            base_model=self._base_model,
            residency_before=residency,
            prefetched=prefetched,
            load_ms=timings,
            queue_wait_ms=round((entry.started - message.accepted_at) * 1000, 3),
            slot_wait_ms=entry.slot_wait_ms,
            to_engine_ms=entry.to_engine_ms,
            ttft_ms=ttft_ms,
            e2e_ms=round((time.time() - message.accepted_at) * 1000, 3),
            worker=self._hostname,
            engine=EngineInfo(name=ENGINE_NAME, version=ENGINE_VERSION),
            routed=message.routed.decision if message.routed else "shared",
            routed_to=message.routed.worker if message.routed else None,
        )

    def _generate_unless_stopped(
        self,
        message: JobMessage,
        staged: Staged,
        timings: LoadTimings,
        entry: EngineEntry,
        running: Running,
        last_chance: bool,
    ) -> Generation:
        metrics.JOB_CPU.labels("start").inc(time.thread_time() - running.cpu_began)
        if message.stream:
            self._deltas.open(message.job_id, running.attempt)
        try:
            future = self._host.submit(
                self._generate_by_deadline(message, staged, timings, entry, running, last_chance)
            )
        except BaseException:
            self._deltas.discard(message.job_id, running.attempt)
            raise
        with running.generating(future):
            try:
                generation = self._host.result(future)
                running.cpu_resumed = time.thread_time()
            except (concurrent.futures.CancelledError, asyncio.CancelledError):
                self._deltas.discard(message.job_id, running.attempt)
                running.check()  # raises JobStopped: the only other reason it is cancelled
                raise
            except BaseException:
                self._deltas.discard(message.job_id, running.attempt)
                raise
        if message.stream:
            try:
                self._deltas.flush(message.job_id, running.attempt, STREAM_FLUSH_S)
            except StreamFenced:
                self._deltas.discard(message.job_id, running.attempt)
                raise JobStopped(StopReason.LEASE_LOST) from None
            except TimeoutError as exc:
                raise StoreUnreachable(str(exc)) from exc
            finally:  # it publishes no more; text still pending is written all the same
                self._deltas.finish(message.job_id, running.attempt)
        return generation

    @contextlib.asynccontextmanager
    async def _alone_if_last_chance(self, last_chance: bool) -> AsyncIterator[None]:
        if not last_chance:
            yield
            return
        async with self._last_chance:
            yield

    async def _generate_by_deadline(
        self,
        message: JobMessage,
        staged: Staged,
        timings: LoadTimings,
        entry: EngineEntry,
        running: Running,
        last_chance: bool,
    ) -> Generation:
        """Wait for a GPU adapter slot, load the adapter into the engine, then generate, but
        no later than the job's deadline: past it (or when the job is cancelled) the engine
        request is aborted (cancelling ``generate`` aborts it in vLLM) and its batch slot
        freed."""
        doing = "waiting for a GPU adapter slot"

        async def slotted() -> Generation:
            async with self._alone_if_last_chance(last_chance):
                entry.asking_for_slot()
                async with self._adapters.slot(staged.request):
                    entry.slot_wait_over()
                    return await admitted()

        async def admitted() -> Generation:
            nonlocal doing
            # A job let in after its engine died (a waiter woken as the dying job left)
            # never ran under it: it must not count that death against itself.
            self._host.check_serving()
            doing = "loading its adapter into the engine"
            resident = await self._adapters.load(staged, timings, message.deadline_at, running)
            if resident.loaded_digest != message.revision:
                # Fail closed: the engine holds something other than the admitted revision.
                raise AdapterIntegrityError(
                    f"Revision {message.revision} was admitted but the engine holds "
                    f"{resident.loaded_digest}."
                )
            doing = "generating"
            running.in_engine = True
            result, ttft_ms = await self._generate(
                message, resident.request, running.attempt, entry
            )
            return Generation(result, ttft_ms, resident.loaded_digest)

        try:
            return await asyncio.wait_for(slotted(), timeout=message.deadline_at - time.time())
        except TimeoutError:
            if doing != "generating":
                raise JobFailure(
                    ErrorCode.DEADLINE_EXCEEDED,
                    f"The job reached its deadline while {doing}; it never entered the engine.",
                ) from None
            self._aborted()
            raise JobFailure(
                ErrorCode.DEADLINE_EXCEEDED,
                "The job reached its deadline while generating; the generation was aborted.",
            ) from None
        except asyncio.CancelledError:
            if doing == "generating":
                self._aborted()
            raise
        finally:
            entry.slot_wait_over()  # a wait the deadline or a cancellation ended counts too

    async def _generate(
        self, message: JobMessage, lora: LoRARequest, attempt: int, entry: EngineEntry
    ) -> tuple[JobResult, float | None]:
        # Unique per attempt: a redelivered job must not collide with a stale engine request.
        request_id = f"{message.job_id}-{uuid.uuid4().hex[:8]}"
        options: dict[str, Any] = {}
        if not message.add_special_tokens:
            # A rendered chat template already holds the special tokens it needs.
            options["tokenization_kwargs"] = {"add_special_tokens": False}
        params = _sampling_params(message.sampling, message.stream)
        final = None
        prompt_token_ids: list[int] = []
        token_ids: list[int] = []
        text: list[str] = []
        entry.arrived()
        outputs = self._host.engine.generate(
            {"prompt": message.prompt}, params, request_id, lora_request=lora, **options
        )
        try:
            with self._adapters.entering(lora):
                async for output in outputs:
                    final = output
                    if not prompt_token_ids and output.prompt_token_ids:  # the same in each
                        prompt_token_ids = list(output.prompt_token_ids)
                    completion = output.outputs[0]
                    token_ids.extend(completion.token_ids)
                    text.append(completion.text)
                    if message.stream and completion.text:
                        self._deltas.publish(message.job_id, attempt, completion.text)
        except EngineDeadError as exc:
            # Recorded here, before this job lets the next one into the engine.
            raise self._host.died(exc) from exc
        if final is None:
            raise RuntimeError(f"the engine returned no output for {request_id}")
        # The engine's own measurement (arrival to first token), not a guess from here.
        stats = final.metrics
        ttft = None
        if stats is not None and getattr(stats, "first_token_latency", 0.0) > 0:
            ttft = round(stats.first_token_latency * 1000, 3)
        result = JobResult(
            text="".join(text),
            token_ids=token_ids,
            finish_reason=final.outputs[0].finish_reason,
            usage=Usage(
                prompt_tokens=len(prompt_token_ids),
                completion_tokens=len(token_ids),
                total_tokens=len(prompt_token_ids) + len(token_ids),
            ),
        )
        return result, ttft
