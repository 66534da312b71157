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
    # As the stack would see a pid reused since its own child died: another start time.
    stop_group(child.pid, timeout_s=5, process=child.process, started_at=child.started_at + 100)
    assert child.alive() and group_alive(child.pid)
    child.stop(timeout_s=5)  # its own start time: stopped
    assert not child.alive()
    assert not group_alive(child.pid)
