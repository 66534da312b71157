"""Warming a process ahead of its first burst (``contracts.warm_process``)."""

from __future__ import annotations

import gc
import subprocess
import sys
import threading
import weakref
from concurrent.futures import ThreadPoolExecutor

import pytest

from contracts.warm_process import freeze_heap, start_threads, thaw_heap
from lorafleet.stack import REPO_ROOT


def test_started_threads_take_the_next_submissions_without_starting_more() -> None:
    # ``_threads``: the executor's own record of its threads (what Celery's stats report).
    with ThreadPoolExecutor(max_workers=8) as executor:
        start_threads(executor, 6)
        assert len(executor._threads) == 6
        # Six tasks that can only finish together, each on a thread of its own: the six
        # started ones take them, and no seventh is started.
        together = threading.Barrier(6)
        futures = [executor.submit(together.wait, 10) for _ in range(6)]
        assert sorted(f.result(timeout=10) for f in futures) == list(range(6))
        assert len(executor._threads) == 6


def test_more_threads_than_the_executor_may_start_time_out_and_leave_it_usable() -> None:
    with ThreadPoolExecutor(max_workers=2) as executor:
        with pytest.raises(TimeoutError, match="3 threads did not start"):
            start_threads(executor, 3, timeout_s=0.5)
        assert executor.submit(lambda: "served").result(timeout=10) == "served"


def test_a_frozen_heap_is_left_to_its_last_thaw_and_what_comes_later_is_still_collected() -> None:
    class Node:
        pass

    def cycle() -> weakref.ref[Node]:
        node = Node()
        node.self = node  # type: ignore[attr-defined]
        return weakref.ref(node)

    before = cycle()  # garbage before the freeze: collected by it
    kept = Node()
    kept.self = kept  # type: ignore[attr-defined]
    frozen_one = weakref.ref(kept)
    try:
        assert freeze_heap() > 0
        assert before() is None
        del kept  # garbage now, but frozen: no collection frees it
        gc.collect()
        assert frozen_one() is not None
        after = cycle()  # made after the freeze: collected as ever
        gc.collect()
        assert after() is None
        # A second holder (another app in the process) freezes too; the first thaw is its.
        freeze_heap()
        thaw_heap()
        assert gc.get_freeze_count() > 0
        gc.collect()
        assert frozen_one() is not None
    finally:
        thaw_heap()
    assert gc.get_freeze_count() == 0
    gc.collect()
    assert frozen_one() is None


REFUSED_MIDWAY = """
from concurrent.futures import ThreadPoolExecutor
from contracts.warm_process import start_threads

class Refusing(ThreadPoolExecutor):
    # Refuses its fourth submission, as an executor that cannot start a thread does.
    submitted = 0

    def submit(self, *args, **kwargs):
        self.submitted += 1
        if self.submitted == 4:
            raise RuntimeError("can't start new thread")
        return super().submit(*args, **kwargs)

try:
    start_threads(Refusing(max_workers=6), 6, timeout_s=30)
except RuntimeError as exc:
    print("refused:", exc)
"""


def test_a_submission_refused_midway_leaves_no_thread_held() -> None:
    # A placeholder left waiting would hold its pool thread for good, and the interpreter
    # joins pool threads at exit: the process would never end.
    done = subprocess.run(
        [sys.executable, "-c", REFUSED_MIDWAY],
        cwd=REPO_ROOT,
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip() == "refused: can't start new thread"
