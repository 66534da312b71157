"""The `lorafleet` command as a user runs it: subprocesses, real Redis and S3, real engine."""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import httpx
from redis import Redis

from contracts.keys import adapter_key
from contracts.queues import Tier, pool_id, queue_for
from contracts.registry import AdapterRecord
from lorafleet.stack import LOCAL_AWS, LocalStack
from tests.helpers import processes_with_env

REPO = Path(__file__).resolve().parents[2]


def _cli(
    args: list[str], env: dict[str, str], timeout_s: float = 600
) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "lorafleet", *args],
        cwd=REPO,
        env=env,
        capture_output=True,
        text=True,
        timeout=timeout_s,
    )


def _isolated_env(state: Path, **extra: str) -> dict[str, str]:
    env = {**os.environ, "LORAFLEET_STATE_DIR": str(state), **extra}
    for key in ("LORAFLEET_REDIS_URL", "LORAFLEET_S3_ENDPOINT_URL"):
        if key not in extra:
            env.pop(key, None)
    return env


def _infra_env(infra: LocalStack, state: Path, fixtures_dir: Path) -> dict[str, str]:
    """The CLI pointed at the session's Redis and S3, serving the fixture base model."""
    return _isolated_env(
        state,
        LORAFLEET_REDIS_URL=infra.redis_url,
        LORAFLEET_S3_ENDPOINT_URL=infra.s3_endpoint_url,
        LORAFLEET_S3_BUCKET=infra.settings.s3_bucket,
        LORAFLEET_MODEL=str(fixtures_dir / "base"),
        **LOCAL_AWS,
    )


def test_publish_is_idempotent_and_refuses_new_bytes_under_an_old_alias(
    infra: LocalStack, redis: Redis, s3: Any, tmp_path: Path, fixtures_dir: Path
) -> None:
    env = _infra_env(infra, tmp_path / "state", fixtures_dir)
    source = fixtures_dir / "adapters" / "lora-01-r4-qkvo"
    args = ["adapters", "publish", str(source), "--alias", "cli-probe", "--tier", "warm"]
    first = _cli(args, env)
    assert first.returncode == 0, first.stderr
    record = AdapterRecord.model_validate_json(redis.get(adapter_key("cli-probe")))  # type: ignore[arg-type]
    assert record.tier == "warm" and record.rank == 4
    assert record.target_modules == ("k_proj", "o_proj", "q_proj", "v_proj")

    again = _cli(args, env)
    assert again.returncode == 0
    assert json.loads(again.stdout)["digest"] == record.digest

    other = tmp_path / "other"
    shutil.copytree(fixtures_dir / "adapters" / "lora-02-r4-qv", other)
    refused = _cli(["adapters", "publish", str(other), "--alias", "cli-probe"], env)
    assert refused.returncode == 1
    assert "alias_exists" in refused.stdout
    assert AdapterRecord.model_validate_json(redis.get(adapter_key("cli-probe"))) == record  # type: ignore[arg-type]

    (other / "adapter_config.json").unlink()
    invalid = _cli(["adapters", "publish", str(other), "--alias", "cli-broken"], env)
    assert invalid.returncode == 1
    assert "adapter_config_missing" in invalid.stdout
    assert redis.get(adapter_key("cli-broken")) is None

    listed = _cli(["adapters", "list"], env)
    assert "cli-probe" in listed.stdout and record.digest in listed.stdout


def test_stack_up_detached_serves_a_published_adapter_then_stack_down_stops_it(
    tmp_path: Path, fixtures_dir: Path
) -> None:
    state = tmp_path / "state"
    env = _isolated_env(
        state, LORAFLEET_MODEL=str(fixtures_dir / "base"), LORAFLEET_WORKER_CONCURRENCY="4"
    )
    try:
        up = _cli(["stack", "up", "--detach"], env)
        assert up.returncode == 0, up.stdout[-2000:] + up.stderr[-2000:]
        stack = json.loads((state / "stack.json").read_text())
        assert {"gateway_url", "api_key", "redis_url", "s3_endpoint_url", "bucket", "model"} <= set(
            stack
        )
        assert set(stack["pids"]) == {"redis", "s3", "gateway", "worker", "webhooks"}

        published = _cli(
            [
                "adapters",
                "publish",
                str(fixtures_dir / "adapters" / "lora-00-r8-qv"),
                "--alias",
                "detached",
                "--tier",
                "hot",
            ],
            env,
        )
        assert published.returncode == 0, published.stdout + published.stderr
        auth = {"Authorization": f"Bearer {stack['api_key']}"}
        with httpx.Client(base_url=stack["gateway_url"], headers=auth) as api:
            accepted = api.post(
                "/v1/jobs",
                json={"adapter": "detached", "prompt": "hi", "sampling": {"max_tokens": 3}},
            ).json()
            deadline = time.monotonic() + 120
            job = api.get(f"/v1/jobs/{accepted['id']}").json()
            while job["status"] not in ("succeeded", "failed") and time.monotonic() < deadline:
                time.sleep(0.1)
                job = api.get(f"/v1/jobs/{accepted['id']}").json()
        assert job["status"] == "succeeded", job
        assert job["metadata"]["identity_verified"] is True
    finally:
        down = _cli(["stack", "down"], env)
    assert down.returncode == 0
    assert "worker" in down.stdout and "redis" in down.stdout
    assert processes_with_env(str(state)) == []


def test_interrupted_demo_stops_everything_it_started(tmp_path: Path) -> None:
    state = tmp_path / "state"
    env = _isolated_env(state)
    process = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "lorafleet",
            "demo",
            "--jobs",
            "5",
            "--report",
            str(tmp_path / "r.json"),
        ],
        cwd=REPO,
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        # Ctrl-C's default meaning, whoever launched the tests: a shell starting them in the
        # background (``cmd &``) ignores SIGINT for them, and Python keeps it ignored.
        preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL),
    )
    assert process.stdout is not None
    for line in process.stdout:  # interrupt while the engine is starting
        if "starting gateway and worker" in line:
            break
    time.sleep(3)
    process.send_signal(signal.SIGINT)
    output = process.communicate(timeout=180)[0]
    assert process.returncode == 130, output
    assert "interrupted" in output
    assert processes_with_env(str(state)) == []
    assert not (tmp_path / "r.json").exists()


def test_demo_that_cannot_start_its_worker_fails_cleanly(tmp_path: Path) -> None:
    state = tmp_path / "state"
    # Fewer CPU-cache places than GPU slots: the worker refuses its settings and exits.
    env = _isolated_env(state, LORAFLEET_MAX_CPU_LORAS="1")
    completed = _cli(["demo", "--jobs", "5", "--report", str(tmp_path / "r.json")], env)
    assert completed.returncode == 1
    assert "demo failed" in completed.stdout
    assert "worker exited" in completed.stdout
    assert "max_cpu_loras must be at least max_loras" in completed.stdout
    assert processes_with_env(str(state)) == []


def test_registry_commands_show_retire_and_move_channels(
    infra: LocalStack, fixtures_dir: Path, tmp_path: Path, published: dict[str, AdapterRecord]
) -> None:
    env = _infra_env(infra, tmp_path / "state", fixtures_dir)
    source = fixtures_dir / "adapters" / "lora-08-r8-qv"
    assert _cli(["adapters", "publish", str(source), "--alias", "cli-a"], env).returncode == 0
    shown = _cli(["adapters", "show", "cli-a"], env)
    assert json.loads(shown.stdout)["retired"] is False

    assert _cli(["channels", "set", "cli-chan", "cli-a"], env).returncode == 0
    assert "cli-chan -> cli-a" in _cli(["channels", "show", "cli-chan"], env).stdout
    assert "cli-chan -> cli-a" in _cli(["channels", "show"], env).stdout
    missing = _cli(["channels", "show", "cli-nope"], env)
    assert missing.returncode == 1 and "channel_not_found" in missing.stdout

    assert _cli(["adapters", "retire", "cli-a"], env).returncode == 0
    assert json.loads(_cli(["adapters", "show", "cli-a"], env).stdout)["retired"] is True
    assert "retired" in _cli(["adapters", "list"], env).stdout
    refused = _cli(["channels", "set", "cli-chan-2", "cli-a"], env)
    assert refused.returncode == 1 and "adapter_retired" in refused.stdout
    unknown = _cli(["adapters", "show", "cli-never"], env)
    assert unknown.returncode == 1 and "adapter_not_found" in unknown.stdout


def test_tenant_key_and_grant_commands(
    infra: LocalStack,
    fixtures_dir: Path,
    tmp_path: Path,
    gateway_url: str,
    published: dict[str, AdapterRecord],
) -> None:
    env = _infra_env(infra, tmp_path / "state", fixtures_dir)
    created = _cli(["tenants", "create", "cli-tenant", "--max-concurrent", "7"], env)
    assert created.returncode == 0, created.stdout + created.stderr
    key = created.stdout.split()[0]
    assert key.startswith("lf_") and "never shown again" in created.stdout
    alias = sorted(published)[0]
    assert _cli(["grants", "add", "cli-tenant", alias], env).returncode == 0
    assert _cli(["grants", "list", "cli-tenant"], env).stdout.split() == [alias]
    assert "max_concurrent 7" in _cli(["tenants", "list"], env).stdout

    listed = _cli(["keys", "list", "cli-tenant"], env).stdout
    key_id = listed.split()[0]
    assert key.startswith(f"lf_{key_id}_") and key not in listed
    with httpx.Client(base_url=gateway_url, headers={"Authorization": f"Bearer {key}"}) as api:
        assert [m["id"] for m in api.get("/v1/models").json()["data"]] == [alias]
        rotated = _cli(["keys", "rotate", "cli-tenant", key_id], env)
        assert rotated.returncode == 0, rotated.stdout
        assert api.get("/v1/models").status_code == 401
        new_key = rotated.stdout.split()[0]
        new_id = _cli(["keys", "list", "cli-tenant"], env).stdout.split()[0]
        auth = {"Authorization": f"Bearer {new_key}"}
        assert api.get("/v1/models", headers=auth).status_code == 200
        assert _cli(["keys", "revoke", "cli-tenant", new_id], env).returncode == 0
        assert api.get("/v1/models", headers=auth).status_code == 401

    refusals = {
        "tenant_exists": ["tenants", "create", "cli-tenant"],
        "name_invalid": ["tenants", "create", "Not A Name"],
        "tenant_not_found": ["grants", "list", "cli-nobody"],
        "key_not_found": ["keys", "revoke", "cli-tenant", "000000000000"],
        "adapter_not_found": ["grants", "add", "cli-tenant", "cli-no-such-adapter"],
    }
    for code, args in refusals.items():
        refused = _cli(args, env)
        assert refused.returncode == 1 and code in refused.stdout, (args, refused.stdout)
    assert _cli(["grants", "list", "cli-tenant"], env).stdout.split() == [alias]

    shown = _cli(["tenants", "webhook-secret", "cli-tenant"], env).stdout.split()
    assert shown[0].startswith("whsec_") and shown[1] == "current"
    rotated = _cli(["tenants", "webhook-secret", "cli-tenant", "--rotate"], env).stdout.split()
    assert rotated[0] != shown[0] and rotated[1] == "current"
    assert rotated[2] == shown[0] and rotated[3] != "current"  # still signing, with an end


def test_pools_lists_each_base_models_pool_and_its_queues(
    infra: LocalStack,
    fixtures_dir: Path,
    tmp_path: Path,
    published: dict[str, AdapterRecord],
) -> None:
    env = _infra_env(infra, tmp_path / "state", fixtures_dir)
    listed = _cli(["pools"], env)
    assert listed.returncode == 0, listed.stdout + listed.stderr
    base = next(iter(published.values())).base_model
    (row,) = [line for line in listed.stdout.splitlines() if base.digest in line]
    pool, model, digest, *queues = row.split()
    assert (pool, model, digest) == (pool_id(base.digest), base.id, base.digest)
    assert queues == [queue_for(tier, base.digest) for tier in Tier]
