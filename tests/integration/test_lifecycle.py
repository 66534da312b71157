"""Processes the stack starts are the processes it stops: on success, failure and SIGTERM."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from lorafleet.processes import group_alive
from lorafleet.settings import LocalSettings
from lorafleet.stack import LocalStack, stop_recorded
from tests.helpers import processes_with_env

REPO = Path(__file__).resolve().parents[2]


def _wait_gone(pgid: int, timeout_s: float) -> bool:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if not group_alive(pgid):
            return True
        time.sleep(0.2)
    return False


def test_stack_down_stops_exactly_the_recorded_processes(
    tmp_path: Path, fixtures_dir: Path
) -> None:
    settings = LocalSettings(state_dir=tmp_path / "state", redis_url=None, s3_endpoint_url=None)
    stack = LocalStack(settings, fixtures_dir / "base")
    stack.start_infra()
    recorded = json.loads(settings.stack_file.read_text())
    assert set(recorded["pids"]) == {"redis", "s3"}
    assert recorded["redis_url"].startswith("redis://127.0.0.1:")
    pids = [child.pid for child in stack.children]
    assert all(group_alive(pid) for pid in pids)

    assert sorted(stop_recorded(settings.stack_file)) == ["redis", "s3"]
    for child in stack.children:
        child.process.wait(timeout=30)
    assert not any(group_alive(pid) for pid in pids)
    assert not settings.stack_file.exists()


def test_demo_runs_reports_verified_identity_and_leaves_no_process(tmp_path: Path) -> None:
    state = tmp_path / "demo-state"
    report = tmp_path / "report.json"
    env = {
        **os.environ,
        "LORAFLEET_STATE_DIR": str(state),
        "LORAFLEET_WORKER_CONCURRENCY": "16",
    }
    env.pop("LORAFLEET_REDIS_URL", None)
    env.pop("LORAFLEET_S3_ENDPOINT_URL", None)
    completed = subprocess.run(
        [sys.executable, "-m", "lorafleet", "demo", "--jobs", "30", "--report", str(report)],
        cwd=REPO,
        env=env,
        capture_output=True,
        text=True,
        timeout=900,
    )
    assert completed.returncode == 0, completed.stdout[-3000:] + completed.stderr[-3000:]
    assert "identity mismatches: 0" in completed.stdout
    data = json.loads(report.read_text())
    assert data["jobs"] == 30
    assert {"hot", "all"} <= set(data["tiers"])
    assert all(job["metadata"]["identity_verified"] for job in data["results"])
    assert data["tiers"]["all"]["identity_mismatched"] == 0
    assert processes_with_env(str(state)) == []
    assert not (state / "stack.json").exists()


@pytest.mark.ends_worker
def test_worker_exits_zero_on_sigterm_and_takes_its_engine_down(stack: LocalStack) -> None:
    worker = next(child for child in stack.children if child.name == "worker")
    assert worker.alive()
    os.kill(worker.pid, signal.SIGTERM)  # the worker process only, not its group
    returncode = worker.process.wait(timeout=120)
    assert returncode == 0, worker.log_tail()
    assert _wait_gone(worker.pid, 30), "the engine's child processes outlived the worker"


def test_servers_die_with_a_stack_that_was_killed(tmp_path: Path, fixtures_dir: Path) -> None:
    state = tmp_path / "state"
    script = (
        "import sys, time\n"
        "from pathlib import Path\n"
        "from lorafleet.settings import LocalSettings\n"
        "from lorafleet.stack import LocalStack\n"
        "if __name__ == '__main__':\n"
        f"    settings = LocalSettings(state_dir=Path({str(state)!r}), redis_url=None,"
        " s3_endpoint_url=None)\n"
        f"    LocalStack(settings, Path({str(fixtures_dir / 'base')!r})).start_infra()\n"
        "    print('up', flush=True)\n"
        "    time.sleep(600)\n"
    )
    owner = subprocess.Popen(
        [sys.executable, "-c", script], cwd=REPO, stdout=subprocess.PIPE, text=True
    )
    assert owner.stdout is not None and owner.stdout.readline().strip() == "up"
    pids = json.loads((state / "stack.json").read_text())["pids"]
    assert all(group_alive(pid) for pid in pids.values())

    owner.kill()  # SIGKILL: no handler, no cleanup in the owner
    owner.wait(timeout=10)
    assert all(_wait_gone(pid, 30) for pid in pids.values()), "a server outlived its stack"
