"""A job's deadline as a bound on every wait the worker makes for it."""

from __future__ import annotations

import time


def remaining_s(deadline_at: float | None) -> float | None:
    """Seconds until ``deadline_at`` (unix time, the gateway's clock), at least 0; ``None``
    when there is no deadline (preloading at start)."""
    if deadline_at is None:
        return None
    return max(0.0, deadline_at - time.time())


def passed(deadline_at: float | None) -> bool:
    return deadline_at is not None and time.time() >= deadline_at
