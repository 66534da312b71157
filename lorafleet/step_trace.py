"""A line per engine step, for benchmarks: what the engine was given, step by step.

vLLM's ``vllm:iteration_tokens_total`` counts steps and tokens; it cannot show *when* the
engine had few requests to batch (requests still on their way to it, a last few running
alone). With ``LORAFLEET_STEP_TRACE`` naming a directory, every vLLM engine core started in
this environment (lorafleet's worker, ``vllm serve``, offline ``LLM``) appends one line per
step that scheduled work to ``steps-<pid>.tsv`` there (the pid of the process that runs the
step): the time, the requests running and waiting in the scheduler, the requests and tokens
scheduled, the new requests among them, and the adapters the running requests use. Unset (the
default), nothing is patched.

It is a vLLM general plugin (entry point ``vllm.general_plugins``; vLLM loads general plugins
in its front-end process and in every engine core as it starts, and a forked engine core
inherits the patch; ``VLLM_PLUGINS``, if set, must name ``lorafleet-step-trace``). The step
reads the scheduler's state only: nothing it decides changes; each line is one line-buffered
write. The trace never stops an engine: a directory it cannot make leaves the scheduler
unpatched, and a step it cannot trace (a line it cannot write, a scheduler whose attributes
changed) is logged once and tracing stops in that process; the step itself goes on.
"""

from __future__ import annotations

import logging
import os
import statistics
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

ENV = "LORAFLEET_STEP_TRACE"
PREFIX = "steps-"

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class Step:
    at: float
    """``time.time()`` as the step was scheduled."""
    running: int
    waiting: int
    """Waiting in the scheduler's queues (those holding KV blocks for a transfer included)."""
    scheduled: int
    """Requests given tokens in this step."""
    tokens: int
    new: int
    """Requests scheduled for the first time (their prefill starts)."""
    adapters: int
    """Distinct adapters among the running requests."""

    def line(self) -> str:
        return (
            f"{self.at:.6f}\t{self.running}\t{self.waiting}\t{self.scheduled}\t{self.tokens}"
            f"\t{self.new}\t{self.adapters}\n"
        )

    @classmethod
    def parse(cls, line: str) -> Step:
        at, *counts = line.split("\t")
        running, waiting, scheduled, tokens, new, adapters = (int(c) for c in counts)
        return cls(float(at), running, waiting, scheduled, tokens, new, adapters)


def observe(scheduler: Any, output: Any) -> Step:
    """The step ``output`` (a ``SchedulerOutput``) of ``scheduler`` (vLLM's v1 scheduler)."""
    adapters = {
        request.lora_request.lora_int_id
        for request in scheduler.running
        if request.lora_request is not None
    }
    return Step(
        at=time.time(),
        running=len(scheduler.running),
        waiting=len(scheduler.waiting) + len(getattr(scheduler, "kv_holding_waiting", ())),
        scheduled=len(output.num_scheduled_tokens),
        tokens=output.total_num_scheduled_tokens,
        new=len(output.scheduled_new_reqs),
        adapters=len(adapters),
    )


def install() -> None:
    """The plugin's entry point: wrap the engine core's scheduling when ``ENV`` is set."""
    directory = os.environ.get(ENV)
    if not directory:
        return
    from vllm.v1.core.sched.scheduler import Scheduler

    if getattr(Scheduler.schedule, "_lorafleet_traced", False):
        return  # plugins may be loaded more than once in a process
    try:
        Path(directory).mkdir(parents=True, exist_ok=True)
    except OSError as exc:
        log.warning("engine steps not traced: %s", exc)
        return
    schedule = Scheduler.schedule
    # The process writing and its file: opened on its first step (only engine cores
    # schedule), named after the process that runs the step, not the one that installed
    # the patch (an engine core forked from vLLM's front end inherits it). "pid" None: no
    # file yet; -1: given up.
    sink: dict[str, Any] = {"pid": None, "file": None}

    def traced(self: Any, *args: Any, **kwargs: Any) -> Any:
        output = schedule(self, *args, **kwargs)
        if output.total_num_scheduled_tokens and sink["pid"] != -1:
            try:
                if sink["pid"] != os.getpid():
                    path = Path(directory) / f"{PREFIX}{os.getpid()}.tsv"
                    sink["file"] = path.open("a", buffering=1)  # a line each: readable mid-run
                    sink["pid"] = os.getpid()
                sink["file"].write(observe(self, output).line())
            except Exception as exc:  # the trace's own failure: never the engine's
                sink["pid"] = -1
                log.warning("engine steps no longer traced: %r", exc)
        return output

    traced._lorafleet_traced = True  # type: ignore[attr-defined]
    Scheduler.schedule = traced  # type: ignore[method-assign]


@dataclass(frozen=True)
class Shape:
    """How full the engine's steps were over one run."""

    steps: int
    mean_batch: float
    """Requests scheduled per step."""
    median_batch: float
    thin_steps: int
    """Steps that scheduled at most an eighth of the run's widest step."""
    first_step_ms: float
    """From the run's start to its first step."""
    to_half_ms: float
    """From the run's start to the first step that found at least half as many requests
    running as the most any step of the run found."""


def shape(steps: list[Step], started: float) -> Shape | None:
    """``steps`` (one run's, in time order; the run started at ``started``, ``time.time()``)
    summed up; ``None`` for a run without steps."""
    if not steps:
        return None
    batches = [step.scheduled for step in steps]
    widest = max(batches)
    peak = max(step.running for step in steps)
    half = next(step.at for step in steps if 2 * step.running >= peak)
    return Shape(
        steps=len(steps),
        mean_batch=statistics.fmean(batches),
        median_batch=float(statistics.median(batches)),
        thin_steps=sum(1 for batch in batches if 8 * batch <= widest),
        first_step_ms=(steps[0].at - started) * 1000,
        to_half_ms=(half - started) * 1000,
    )


def read(directory: Path, start: float, end: float) -> list[Step]:
    """Every step traced in ``directory`` from ``start`` to ``end`` (``time.time()``), in
    time order, whichever engine core wrote it."""
    return within(sorted(_all(directory), key=lambda s: s.at), start, end)


def within(steps: list[Step], start: float, end: float) -> list[Step]:
    """The steps of ``steps`` from ``start`` to ``end``, in their order (many windows of one
    ``read``: the files are read once)."""
    return [step for step in steps if start <= step.at <= end]


def _all(directory: Path) -> Iterator[Step]:
    for path in directory.glob(f"{PREFIX}*.tsv"):
        with path.open() as lines:
            for line in lines:
                if line.endswith("\n"):  # a line being written is left for the next read
                    yield Step.parse(line)
