"""A job's deadline as a bound on every wait the worker makes for it."""

from __future__ import annotations

import time

from contracts.errors import ErrorCode
from worker.errors import JobFailure


def remaining_s(deadline_at: float | None) -> float | None:
    """Seconds until ``deadline_at`` (unix time, the gateway's clock), at least 0; ``None``
    when there is no deadline (preloading at start)."""
    if deadline_at is None:
        return None
    return max(0.0, deadline_at - time.time())


def passed(deadline_at: float | None) -> bool:
    return deadline_at is not None and time.time() >= deadline_at


def late(doing: str) -> JobFailure:
    """The failure of a job whose deadline came while it ``doing`` (a phrase in the past)."""
    return JobFailure(
        ErrorCode.DEADLINE_EXCEEDED, f"The job reached its deadline while it {doing}; not run."
    )
