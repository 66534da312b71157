"""Job failures a worker reports: a stable code plus a sentence for humans."""

from __future__ import annotations

from enum import StrEnum

from contracts.errors import ErrorCode
from contracts.jobs import ResultMetadata


class JobFailure(Exception):
    """A job ends ``failed`` with ``code``; generation never ran on any other weights."""

    def __init__(self, code: ErrorCode, message: str) -> None:
        super().__init__(message)
        self.code = code
        self.message = message
        # What the worker observed before failing (set by the runner).
        self.metadata: ResultMetadata | None = None

    def copy(self) -> JobFailure:
        """The same failure for another job (one shared download failing all its waiters):
        each job gets its own, to carry its own metadata."""
        again = JobFailure(self.code, self.message)
        again.__class__ = type(self)
        return again


class AdapterIntegrityError(JobFailure):
    def __init__(self, message: str) -> None:
        super().__init__(ErrorCode.ADAPTER_INTEGRITY, message)


class AdapterUnavailableError(JobFailure):
    def __init__(self, message: str) -> None:
        super().__init__(ErrorCode.ADAPTER_UNAVAILABLE, message)


class StopReason(StrEnum):
    """Why this process stopped a job it was running."""

    CANCELLED = "cancelled"  # a caller cancelled it: the record already says so
    DRAIN = "drain"  # the worker is shutting down and its drain timeout passed: give it back
    ENGINE_FAILED = "engine_failed"  # the engine died or stopped answering: give it back
    LEASE_LOST = "lease_lost"  # another attempt owns the job now: write nothing


class JobStopped(Exception):
    """The job was stopped before it finished; its engine request (if any) was aborted."""

    def __init__(self, reason: StopReason) -> None:
        super().__init__(reason.value)
        self.reason = reason


class StoreUnreachable(Exception):
    """Redis did not take what the job must store (its outcome, its streamed text) in time;
    the delivery goes back to its queue rather than being acknowledged."""
