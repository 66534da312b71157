"""Stopping the stack's children never signals a process that got one of their pids later."""

from __future__ import annotations

import sys
from pathlib import Path

from lorafleet.processes import group_alive, spawn, stop_group


def test_a_group_whose_pid_another_program_got_is_left_alone(tmp_path: Path) -> None:
    child = spawn(
        "sleeper", [sys.executable, "-c", "import time; time.sleep(60)"], {}, tmp_path, tmp_path
    )
    assert child.started_at is not None
    # As `stack down` sees a recorded pid (no process handle) that another program got since:
    # another start time.
    stop_group(child.pid, timeout_s=5, started_at=child.started_at + 100)
    assert child.alive() and group_alive(child.pid)
    child.stop(timeout_s=5)  # its own start time: stopped
    assert not child.alive()
    assert not group_alive(child.pid)


def test_our_own_unreaped_child_is_stopped_whatever_the_clock_says(tmp_path: Path) -> None:
    """Start times are wall clock; a VM's clock step moves them. A child this process has not
    reaped keeps its pid, so it is stopped even when the start times no longer agree."""
    child = spawn(
        "sleeper", [sys.executable, "-c", "import time; time.sleep(60)"], {}, tmp_path, tmp_path
    )
    assert child.started_at is not None
    stop_group(child.pid, timeout_s=5, process=child.process, started_at=child.started_at + 1)
    assert not child.alive()
    assert not group_alive(child.pid)
