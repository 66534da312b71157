"""Stopping running jobs from another thread (pure logic, no engine)."""

from __future__ import annotations

import concurrent.futures
import threading

import pytest

from worker.errors import JobStopped, StopReason
from worker.inflight import InFlight


def test_a_job_stopped_before_it_generates_stops_at_its_next_check() -> None:
    inflight = InFlight()
    with inflight.track("a", 1) as running:
        running.check()  # not stopped: no error
        assert inflight.stop("a", StopReason.CANCELLED)
        with pytest.raises(JobStopped) as caught:
            running.check()
        assert caught.value.reason == StopReason.CANCELLED
        # A future handed over after the stop is cancelled at once.
        future: concurrent.futures.Future[int] = concurrent.futures.Future()
        with running.generating(future):
            assert future.cancelled()
    assert inflight.job_ids() == []
    assert not inflight.stop("a", StopReason.CANCELLED)  # no longer tracked


def test_stopping_a_generating_job_cancels_its_engine_future_and_first_reason_wins() -> None:
    inflight = InFlight()
    future: concurrent.futures.Future[int] = concurrent.futures.Future()
    with inflight.track("a", 1) as running, running.generating(future):
        stopper = threading.Thread(target=inflight.stop_all, args=(StopReason.DRAIN,))
        stopper.start()
        stopper.join()
        assert future.cancelled()
        inflight.stop("a", StopReason.CANCELLED)
        with pytest.raises(JobStopped) as caught:
            running.check()
        assert caught.value.reason == StopReason.DRAIN


def test_only_the_named_job_is_stopped() -> None:
    inflight = InFlight()
    with inflight.track("a", 1) as first, inflight.track("b", 1) as second:
        assert sorted(inflight.job_ids()) == ["a", "b"] and len(inflight) == 2
        inflight.stop("b", StopReason.CANCELLED)
        first.check()
        with pytest.raises(JobStopped):
            second.check()
