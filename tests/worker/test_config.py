from __future__ import annotations

import random
import socket
import subprocess
from pathlib import Path

import pytest
from pydantic import ValidationError

from lorafleet.stack import LocalStack, procfile_commands
from worker import metrics
from worker.config import WorkerSettings
from worker.webhooks.config import WebhookSettings


def test_settings_come_from_the_environment_as_strings(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("LORAFLEET_MAX_LORA_RANK", "16")
    monkeypatch.setenv("LORAFLEET_MAX_LORAS", "3")
    monkeypatch.setenv("LORAFLEET_MAX_CPU_LORAS", "6")
    monkeypatch.setenv("LORAFLEET_ENFORCE_EAGER", "true")
    settings = WorkerSettings()
    assert settings.max_lora_rank == 16 and settings.lora_rank == 16
    assert (settings.max_loras, settings.max_cpu_loras, settings.enforce_eager) == (3, 6, True)


@pytest.mark.parametrize(
    ("env", "message"),
    [
        ({"LORAFLEET_MAX_LORA_RANK": "7"}, "max_lora_rank must be one of"),
        ({"LORAFLEET_MAX_LORAS": "4", "LORAFLEET_MAX_CPU_LORAS": "2"}, "max_cpu_loras must be"),
        ({"LORAFLEET_GPU_MEMORY_UTILIZATION": "1.5"}, "gpu_memory_utilization"),
        # 600 s deadline + (4 x 10 s + 2 s) heartbeat expiry + 10 s restore interval = 652 s
        ({"LORAFLEET_VISIBILITY_TIMEOUT_S": "652"}, "visibility_timeout_s must exceed"),
        (
            {"LORAFLEET_JOB_DEADLINE_S": "30", "LORAFLEET_VISIBILITY_TIMEOUT_S": "40"},
            "= 82 s",
        ),
        ({"LORAFLEET_MAX_ATTEMPTS": "0"}, "max_attempts"),
        # A job's record expires job_ttl_s after admission unless written again: it must
        # outlive the job (600 s deadline + 10 s sweep grace + 5 s sweep interval = 615 s).
        ({"LORAFLEET_JOB_TTL_S": "615"}, "job_ttl_s must exceed"),
    ],
)
def test_unsafe_settings_are_refused_at_start(
    monkeypatch: pytest.MonkeyPatch, env: dict[str, str], message: str
) -> None:
    for key, value in env.items():
        monkeypatch.setenv(key, value)
    with pytest.raises(ValidationError) as caught:
        WorkerSettings()
    assert message in str(caught.value)


def test_visibility_timeout_just_above_the_floor_is_accepted(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setenv("LORAFLEET_VISIBILITY_TIMEOUT_S", "653")
    settings = WorkerSettings()
    assert settings.announcement_ttl_s == 42
    assert settings.visibility_timeout_s == 653


def test_the_deadline_a_visibility_timeout_covers_is_checked_per_job() -> None:
    """The check runs on each job's own deadline, not on a copy of the gateway's setting: a
    worker configured for 600 s still notices a job stamped by a gateway allowing 3600 s."""
    settings = WorkerSettings()
    # 900 s visibility - (4 x 10 s + 2 s) heartbeat expiry - 10 s restore interval = 848 s
    assert settings.covers(settings.job_deadline_s)
    assert settings.covers(848) and not settings.covers(848.5)
    assert not settings.covers(3600)


def test_a_webhook_retry_window_the_event_would_not_outlive_is_refused(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    # An event's payload is its job's record, kept job_ttl_s: a retry after that finds
    # nothing to send and the event ends dead, inside its window.
    monkeypatch.setenv("LORAFLEET_JOB_TTL_S", "3600")
    monkeypatch.setenv("LORAFLEET_WEBHOOK_RETRY_WINDOW_S", "3600")
    with pytest.raises(ValidationError) as caught:
        WebhookSettings()
    assert "webhook_retry_window_s must be shorter than job_ttl_s" in str(caught.value)
    monkeypatch.delenv("LORAFLEET_JOB_TTL_S")
    monkeypatch.delenv("LORAFLEET_WEBHOOK_RETRY_WINDOW_S")
    defaults = WebhookSettings()
    assert defaults.webhook_retry_window_s < defaults.job_ttl_s


def _run_worker(
    infra: LocalStack, env: dict[str, str], timeout_s: float
) -> subprocess.CompletedProcess[str]:
    """The Procfile's worker command on ``infra`` with ``env`` over the stack's service
    environment, run to its exit (at most ``timeout_s``)."""
    return subprocess.run(
        ["sh", "-c", "exec " + procfile_commands()["worker"]],
        env={**infra.service_env(), **env},
        capture_output=True,
        text=True,
        timeout=timeout_s,
    )


def test_a_worker_whose_runtime_cannot_be_built_exits_and_says_why(
    infra: LocalStack, tmp_path: Path
) -> None:
    """A setting that validates but names something unusable (here a model directory that does
    not exist) fails while the worker builds its runtime, inside Celery's ``worker_init``
    signal, which swallows exceptions: the worker must not then run on, "ready" and taking
    nothing (its queues are selected by the runtime), with no word of why. It exits 1, and its
    output names the cause."""
    done = _run_worker(
        infra,
        {
            "LORAFLEET_MODEL": str(tmp_path / "no-such-model"),
            "LORAFLEET_CACHE_DIR": str(tmp_path / "cache"),
            "LORAFLEET_METRICS_PORT": "0",
            "LORAFLEET_WORKER_NAME": "unbuildable@%h",
        },
        timeout_s=120,
    )
    assert done.returncode == 1, done.stderr[-3000:]
    assert "worker runtime could not be built" in done.stderr, done.stderr[-3000:]
    assert "no-such-model" in done.stderr, done.stderr[-3000:]
    assert " ready." not in done.stderr


def _busy_ports(count: int) -> tuple[int, list[socket.socket]]:
    """``count`` consecutive ports, each held by a listening socket: (the first, the sockets)."""
    for _ in range(50):
        first = random.randint(20_000, 60_000 - count)
        held: list[socket.socket] = []
        try:
            for port in range(first, first + count):
                sock = socket.socket()
                held.append(sock)
                sock.bind(("", port))
                sock.listen()
            return first, held
        except OSError:
            for sock in held:
                sock.close()
    raise AssertionError(f"no {count} free consecutive ports")


def test_a_worker_that_cannot_announce_itself_exits(infra: LocalStack, tmp_path: Path) -> None:
    """Announcing happens once Celery's consumer runs (``worker_ready``), inside a signal that
    swallows exceptions: a worker whose announcement fails (here every metrics port it may take
    is busy) would take jobs with no heartbeat, lease keeper or reaper. It leaves instead, exit
    code 1, its engine shut down with it, and says why."""
    first, held = _busy_ports(metrics.PORT_ATTEMPTS)
    try:
        done = _run_worker(
            infra,
            {
                "LORAFLEET_METRICS_PORT": str(first),
                "LORAFLEET_CACHE_DIR": str(tmp_path / "cache"),
                "LORAFLEET_WORKER_NAME": "unannounced@%h",
            },
            timeout_s=600,
        )
    finally:
        for sock in held:
            sock.close()
    assert done.returncode == 1, done.stderr[-3000:]
    assert "worker could not announce itself" in done.stderr, done.stderr[-3000:]
    assert "no free metrics port" in done.stderr, done.stderr[-3000:]
