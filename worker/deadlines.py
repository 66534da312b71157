"""A job's deadline as a bound on every wait the worker makes for it."""

from __future__ import annotations

import time
from collections.abc import Callable

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


CHECK_EVERY_S = 0.25
"""How often a job waiting on something shared (a download, another job's load) looks whether
it was stopped meanwhile (engine failure, drain, cancel)."""


def wait_slice(deadline_at: float | None, check: Callable[[], None] | None) -> float | None:
    """The next bounded wait of a job: ``check()`` first (it raises once the job is stopped),
    then up to the deadline, in slices of ``CHECK_EVERY_S`` when there is a check to repeat."""
    wait_s = remaining_s(deadline_at)
    if check is None:
        return wait_s
    check()
    return CHECK_EVERY_S if wait_s is None else min(wait_s, CHECK_EVERY_S)
