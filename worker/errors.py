"""Job failures a worker reports: a stable code plus a sentence for humans."""

from __future__ import annotations

from contracts.errors import ErrorCode


class JobFailure(Exception):
    """A job ends ``failed`` with ``code``; generation never ran on any other weights."""

    def __init__(self, code: ErrorCode, message: str) -> None:
        super().__init__(message)
        self.code = code
        self.message = message


class AdapterIntegrityError(JobFailure):
    def __init__(self, message: str) -> None:
        super().__init__(ErrorCode.ADAPTER_INTEGRITY, message)


class AdapterUnavailableError(JobFailure):
    def __init__(self, message: str) -> None:
        super().__init__(ErrorCode.ADAPTER_UNAVAILABLE, message)
