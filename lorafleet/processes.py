"""Child processes of the local stack: each in its own process group, logged to a file."""

from __future__ import annotations

import ctypes
import os
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from types import FrameType

import psutil

PR_SET_PDEATHSIG = 1
_LINUX = sys.platform.startswith("linux")
# Resolved here, in the parent: the child between fork and exec must not load libraries.
_LIBC = ctypes.CDLL(None, use_errno=True) if _LINUX else None


def free_port() -> int:
    """A TCP port on 127.0.0.1 that was free a moment ago."""
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port: int = sock.getsockname()[1]
        return port


@dataclass
class Child:
    """A started service; its pid is also its process-group id."""

    name: str
    process: subprocess.Popen[bytes]
    log_path: Path
    started_at: float | None = None
    """When the kernel started it (``psutil``'s create time): tells it from a later process
    that got the same pid once it was gone (pids are reused, fast on a busy machine)."""

    @property
    def pid(self) -> int:
        return self.process.pid

    def stop(self, timeout_s: float = 30.0) -> None:
        """SIGTERM its process group, then SIGKILL what is left after ``timeout_s``."""
        stop_group(self.pid, timeout_s, self.process, self.started_at)

    def alive(self) -> bool:
        return self.process.poll() is None

    def log_tail(self, lines: int = 30) -> str:
        try:
            return "\n".join(self.log_path.read_text(errors="replace").splitlines()[-lines:])
        except OSError:
            return ""


def _terminate_with_parent() -> None:
    """In the child, before exec: the kernel sends SIGTERM when the parent dies (Linux)."""
    if _LIBC is not None:
        _LIBC.prctl(PR_SET_PDEATHSIG, signal.SIGTERM)


def spawn(
    name: str,
    argv: list[str],
    env: dict[str, str],
    log_dir: Path,
    cwd: Path,
    die_with_parent: bool = True,
) -> Child:
    """Start ``argv`` in a new session (so the whole tree can be signalled at once).

    With ``die_with_parent`` (Linux) the child is sent SIGTERM if this process dies without
    cleaning up, even by SIGKILL, so no server outlives the command that started it.
    """
    log_dir.mkdir(parents=True, exist_ok=True)
    log_path = log_dir / f"{name}.log"
    with log_path.open("ab") as log:
        process = subprocess.Popen(
            argv,
            env=env,
            cwd=cwd,
            stdin=subprocess.DEVNULL,
            stdout=log,
            stderr=subprocess.STDOUT,
            start_new_session=True,
            preexec_fn=_terminate_with_parent if die_with_parent and _LINUX else None,
        )
    return Child(name=name, process=process, log_path=log_path, started_at=created_at(process.pid))


def created_at(pid: int) -> float | None:
    """The kernel's start time of ``pid`` (``None`` if it is gone already)."""
    try:
        return float(psutil.Process(pid).create_time())
    except psutil.Error:
        return None


def interrupt_on_signal(signum: int, _: FrameType | None) -> None:
    """Signal handler: SIGTERM takes the same clean-up path as Ctrl-C."""
    raise KeyboardInterrupt(f"signal {signum}")


def group_alive(pgid: int) -> bool:
    """Some process of group ``pgid`` still runs (zombies awaiting their reaper do not count)."""
    proc = Path("/proc")
    if not proc.is_dir():  # not Linux: ask the kernel, zombies included
        try:
            os.killpg(pgid, 0)
        except ProcessLookupError:
            return False
        return True
    for entry in proc.iterdir():
        if not entry.name.isdigit():
            continue
        try:
            stat = (entry / "stat").read_text()
        except OSError:
            continue
        # Fields after the parenthesised command name: state, ppid, pgrp, ...
        fields = stat.rsplit(")", 1)[1].split()
        if int(fields[2]) == pgid and fields[0] != "Z":
            return True
    return False


def still_ours(pgid: int, started_at: float | None) -> bool:
    """Group ``pgid`` is still the one whose leader started at ``started_at``. A pid that is
    still some group's id is never given to a new process, so the group is ours while a
    member lives; once all are gone the pid may be reused, by a new leader of its own group
    (another program's server, say) whose start time then differs."""
    if started_at is None:
        return True
    leader = created_at(pgid)
    return leader is None or abs(leader - started_at) < 0.05


def stop_group(
    pgid: int,
    timeout_s: float = 30.0,
    process: subprocess.Popen[bytes] | None = None,
    started_at: float | None = None,
) -> None:
    """SIGTERM the process group, wait up to ``timeout_s``, then SIGKILL what is left.

    With ``started_at`` (the leader's start time), a group whose pid another program got
    since is left alone. A leader that is our own child and not yet reaped (``process``)
    keeps its pid: it is ours whatever the clock says (the start times compared are wall
    clock, which a VM's clock step moves; that once left a worker running here)."""

    def ours() -> bool:
        if process is not None and process.returncode is None:
            return True  # not reaped: the kernel cannot have given its pid to anyone else
        return still_ours(pgid, started_at)

    if not ours():
        return
    try:
        os.killpg(pgid, signal.SIGTERM)
    except ProcessLookupError:
        return
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if process is not None:
            process.poll()  # reap the leader so the group can disappear
        if not group_alive(pgid):
            return
        time.sleep(0.1)
    if not ours():
        return
    try:
        os.killpg(pgid, signal.SIGKILL)
    except ProcessLookupError:
        return
    if process is not None:
        process.wait(timeout=10)


def wait_until(
    check: Callable[[], bool], timeout_s: float, what: str, watch: list[Child] | None = None
) -> None:
    """Poll ``check`` until true; fail early if a watched child dies meanwhile."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        for child in watch or []:
            if not child.alive():
                raise RuntimeError(
                    f"{child.name} exited with {child.process.returncode} while waiting for "
                    f"{what}; last lines of {child.log_path}:\n{child.log_tail()}"
                )
        try:
            if check():
                return
        except Exception:  # not up yet: connection refused, 5xx, ...
            pass
        time.sleep(0.25)
    raise TimeoutError(f"timed out after {timeout_s:.0f} s waiting for {what}")
