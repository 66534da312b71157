"""Job failures a worker reports: a stable code plus a sentence for humans."""

from __future__ import annotations

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


class AdapterIntegrityError(JobFailure):
    def __init__(self, message: str) -> None:
        super().__init__(ErrorCode.ADAPTER_INTEGRITY, message)


class AdapterUnavailableError(JobFailure):
    def __init__(self, message: str) -> None:
        super().__init__(ErrorCode.ADAPTER_UNAVAILABLE, message)
