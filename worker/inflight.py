"""The jobs this worker process is running, and a way to stop any of them from any thread.

A job is stopped either before it reaches the engine (checked at each step of the runner) or
while generating: cancelling the future of its engine coroutine cancels the coroutine, and
vLLM aborts a request whose ``generate`` is cancelled, freeing its batch slot.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Iterator
from concurrent.futures import Future
from contextlib import contextmanager
from typing import Any

from worker.errors import JobStopped, StopReason


class Running:
    """One attempt of a job in flight in this process."""

    def __init__(self, job_id: str, attempt: int, cpu_began: float | None = None) -> None:
        self.job_id = job_id
        self.attempt = attempt
        # CPU time (``time.thread_time``) of the job's thread when its task began, and when
        # the engine's result came back: the worker's own cost of starting and finishing it.
        self.cpu_began = time.thread_time() if cpu_began is None else cpu_began
        self.cpu_resumed: float | None = None
        # Set on the engine loop once the job's request is in the engine: if the engine dies
        # from then on, the job was generating under it.
        self.in_engine = False
        self._lock = threading.Lock()
        self._reason: StopReason | None = None
        self._future: Future[Any] | None = None

    def stop(self, reason: StopReason) -> None:
        """Stop the job (first reason wins); aborts its engine request if it has one."""
        with self._lock:
            if self._reason is None:
                self._reason = reason
            future = self._future
        if future is not None:
            future.cancel()

    def check(self) -> None:
        """Raise ``JobStopped`` if the job was stopped."""
        with self._lock:
            reason = self._reason
        if reason is not None:
            raise JobStopped(reason)

    @contextmanager
    def generating(self, future: Future[Any]) -> Iterator[None]:
        """While the engine works on ``future``, ``stop`` cancels it."""
        with self._lock:
            self._future = future
            stopped = self._reason is not None
        if stopped:
            future.cancel()
        try:
            yield
        finally:
            with self._lock:
                self._future = None


class InFlight:
    """Thread-safe registry of ``Running`` jobs keyed by job id."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._jobs: dict[str, Running] = {}

    @contextmanager
    def track(self, job_id: str, attempt: int, cpu_began: float | None = None) -> Iterator[Running]:
        running = Running(job_id, attempt, cpu_began)
        with self._lock:
            self._jobs[job_id] = running
        try:
            yield running
        finally:
            with self._lock:
                if self._jobs.get(job_id) is running:
                    del self._jobs[job_id]

    def job_ids(self) -> list[str]:
        with self._lock:
            return list(self._jobs)

    def attempts(self) -> list[tuple[str, int]]:
        """``(job id, attempt)`` of every job in flight."""
        with self._lock:
            return [(job_id, running.attempt) for job_id, running in self._jobs.items()]

    def __len__(self) -> int:
        with self._lock:
            return len(self._jobs)

    def stop(self, job_id: str, reason: StopReason) -> bool:
        """Stop ``job_id`` if this process runs it."""
        with self._lock:
            running = self._jobs.get(job_id)
        if running is None:
            return False
        running.stop(reason)
        return True

    def stop_all(self, reason: StopReason) -> int:
        with self._lock:
            jobs = list(self._jobs.values())
        for running in jobs:
            running.stop(reason)
        return len(jobs)
