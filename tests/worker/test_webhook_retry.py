"""The retry schedule a failed callback attempt records (pure: no Redis, no receiver)."""

from __future__ import annotations

import itertools
from types import SimpleNamespace
from typing import Any

import pytest

from contracts.webhooks import DeliveryState
from worker.webhooks import deliver
from worker.webhooks.config import WebhookSettings
from worker.webhooks.deliver import Deliverer
from worker.webhooks.schedule import Event


def test_the_recorded_gap_is_the_delay_chosen_however_late_the_thread_runs(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """The next attempt's time and the attempt's own are one clock reading apart by exactly
    the chosen delay: a thread descheduled between two readings (the clock jumps a second
    each time it is read here) must not shorten the recorded gap (CI's retry-schedule test
    allows 10 ms)."""
    clock = itertools.count(1_000_000.0, 1.0)
    # The module's own names only (the clock of every other thread is left alone).
    monkeypatch.setattr(deliver, "time", SimpleNamespace(time=lambda: next(clock)))
    monkeypatch.setattr(deliver, "random", SimpleNamespace(uniform=lambda low, high: high))
    settings = WebhookSettings(webhook_backoff_s=4.0, webhook_backoff_max_s=300.0)
    deliverer = Deliverer(None, settings)  # type: ignore[arg-type]
    try:
        event = Event("evt", "https://x", "t", "job", "j", DeliveryState.PENDING, 2, 1_000_000.0)
        conclusion: Any = deliverer._retry(event, 503, "HTTP 503", None)
    finally:
        deliverer.close()
    assert conclusion.state == DeliveryState.PENDING
    assert conclusion.next_attempt_at - conclusion.attempted_at == 4.0 * 2**2
