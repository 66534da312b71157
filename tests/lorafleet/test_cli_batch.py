"""``lorafleet batch`` and ``lorafleet jobs`` against the session's stack, as a user runs them."""

from __future__ import annotations

import json
import signal
import subprocess
import sys
from pathlib import Path
from typing import Any

from contracts.registry import AdapterRecord
from lorafleet.publish import Publisher
from lorafleet.stack import LocalStack
from tests.lorafleet.test_cli import REPO, _cli, _isolated_env
from tests.oracle import PeftOracle

PROMPTS = ["Extract the total amount", "Translate the paragraph into", "The quick brown fox"]
GREEDY = {"max_tokens": 6, "temperature": 0.0, "ignore_eos": True}


def _env(stack: LocalStack, tmp_path: Path) -> tuple[dict[str, str], list[str]]:
    return _isolated_env(tmp_path / "state"), [
        "--gateway",
        stack.gateway_url,
        "--key",
        stack.api_key,
    ]


def _lines(aliases: list[str], count: int) -> list[dict[str, Any]]:
    return [
        {
            "custom_id": f"line-{n}",
            "adapter": aliases[n % len(aliases)],
            "prompt": PROMPTS[n % len(PROMPTS)],
            "sampling": GREEDY,
        }
        for n in range(count)
    ]


def _write(path: Path, lines: list[dict[str, Any]]) -> Path:
    path.write_text("".join(json.dumps(line) + "\n" for line in lines))
    return path


def test_batch_run_writes_every_result_in_input_order_equal_to_its_reference(
    stack: LocalStack,
    published: dict[str, AdapterRecord],
    oracle: PeftOracle,
    tmp_path: Path,
) -> None:
    env, target = _env(stack, tmp_path)
    aliases = sorted(published)[:5]
    lines = _lines(aliases, 50)
    out = tmp_path / "out.jsonl"
    ran = _cli(
        ["batch", "run", str(_write(tmp_path / "in.jsonl", lines)), "--out", str(out), *target], env
    )
    assert ran.returncode == 0, ran.stdout + ran.stderr
    assert "50 jobs admitted" in ran.stdout and "50 succeeded, 0 did not" in ran.stdout
    results = [json.loads(line) for line in out.read_text().splitlines()]
    assert [r["custom_id"] for r in results] == [line["custom_id"] for line in lines]
    for line, result in zip(lines, results, strict=True):
        assert result["status"] == "succeeded", result
        expected = oracle.tokens(line["adapter"], line["prompt"], GREEDY["max_tokens"])
        assert result["result"]["token_ids"] == list(expected), line["custom_id"]
        assert result["metadata"]["identity_verified"] is True
    assert not list(tmp_path.glob("*.partial"))


def test_batch_run_exits_non_zero_with_a_summary_when_a_line_fails_or_is_refused(
    stack: LocalStack,
    published: dict[str, AdapterRecord],
    publisher: Publisher,
    tmp_path: Path,
) -> None:
    env, target = _env(stack, tmp_path)
    aliases = sorted(published)[:2]
    # An adapter whose artifact is not in the store: admitted, its job fails on the worker.
    source = published[aliases[0]]
    ghost = source.model_copy(update={"alias": "cli-ghost", "digest": "sha256:" + "1" * 64})
    publisher.registry.register(ghost)
    lines = _lines(aliases, 6)
    lines[3]["adapter"] = "cli-ghost"
    out = tmp_path / "out.jsonl"
    ran = _cli(
        ["batch", "run", str(_write(tmp_path / "in.jsonl", lines)), "--out", str(out), *target], env
    )
    assert ran.returncode == 3, ran.stdout + ran.stderr
    assert "5 succeeded, 1 did not" in ran.stdout and "adapter_unavailable" in ran.stdout
    results = [json.loads(line) for line in out.read_text().splitlines()]
    assert [r["status"] for r in results] == ["succeeded"] * 3 + ["failed"] + ["succeeded"] * 2
    # A line the gateway refuses (no such adapter): nothing admitted, nothing written.
    lines[3]["adapter"] = "no-such-adapter"
    refused_out = tmp_path / "refused.jsonl"
    refused = _cli(
        [
            "batch",
            "run",
            str(_write(tmp_path / "bad.jsonl", lines)),
            "--out",
            str(refused_out),
            *target,
        ],
        env,
    )
    assert refused.returncode == 2, refused.stdout + refused.stderr
    assert refused.stderr.startswith("batch_invalid: ")
    assert "line 4: " in refused.stderr and "no-such-adapter" in refused.stderr, refused.stderr
    assert not refused_out.exists()


def test_jobs_submit_wait_get_and_cancel(
    stack: LocalStack, published: dict[str, AdapterRecord], tmp_path: Path
) -> None:
    env, target = _env(stack, tmp_path)
    alias = sorted(published)[0]
    submitted = _cli(
        ["jobs", "submit", alias, "Extract the total", "--wait", "--json", *target], env
    )
    assert submitted.returncode == 0, submitted.stdout + submitted.stderr
    job = json.loads(submitted.stdout)
    assert job["status"] == "succeeded" and job["metadata"]["identity_verified"] is True
    shown = _cli(["jobs", "get", job["id"], *target], env)
    assert shown.returncode == 0 and "identity verified" in shown.stdout, shown.stdout
    late = _cli(["jobs", "cancel", job["id"], *target], env)
    assert late.returncode == 2 and late.stderr.startswith("job_finished: "), late.stderr
    missing = _cli(["jobs", "get", "0" * 32, *target], env)
    assert missing.returncode == 2 and missing.stderr.startswith("job_not_found: ")


def test_ctrl_c_leaves_the_batch_running_and_watch_re_attaches(
    stack: LocalStack, published: dict[str, AdapterRecord], tmp_path: Path
) -> None:
    env, target = _env(stack, tmp_path)
    lines = _lines(sorted(published)[:3], 24)
    for line in lines:
        line["sampling"] = {**GREEDY, "max_tokens": 64}  # long enough to interrupt it
    out = tmp_path / "out.jsonl"
    source = _write(tmp_path / "in.jsonl", lines)
    command = [sys.executable, "-m", "lorafleet", "batch", "run", str(source), "--out", str(out)]
    running = subprocess.Popen(
        [*command, *target],
        cwd=REPO,
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        # A shell's background job inherits SIGINT ignored, and Python then installs no
        # KeyboardInterrupt handler: the CLI gets the disposition a terminal would give it.
        preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL),
    )
    assert running.stdout is not None
    admitted = running.stdout.readline()  # "batch <id>: 24 jobs admitted"
    batch_id = admitted.split()[1].rstrip(":")
    running.send_signal(signal.SIGINT)
    stdout, stderr = running.communicate(timeout=60)
    assert running.returncode == 130, stdout + stderr
    assert f"lorafleet batch watch {batch_id} --out {out}" in stderr, stdout + stderr
    assert not out.exists()
    watched = _cli(["batch", "watch", batch_id, "--out", str(out), *target], env)
    assert watched.returncode == 0, watched.stdout + watched.stderr
    results = [json.loads(line) for line in out.read_text().splitlines()]
    assert [r["custom_id"] for r in results] == [line["custom_id"] for line in lines]
    assert {r["status"] for r in results} == {"succeeded"}


def test_batch_run_takes_openai_batch_files_too(
    stack: LocalStack, published: dict[str, AdapterRecord], tmp_path: Path
) -> None:
    env, target = _env(stack, tmp_path)
    alias = sorted(published)[0]
    lines = [
        {
            "custom_id": f"openai-{n}",
            "method": "POST",
            "url": "/v1/completions",
            "body": {"model": alias, "prompt": PROMPTS[n], "max_tokens": 4, "temperature": 0},
        }
        for n in range(3)
    ]
    out = tmp_path / "out.jsonl"
    source = _write(tmp_path / "openai.jsonl", lines)
    ran = _cli(["batch", "run", str(source), "--out", str(out), *target], env)
    assert ran.returncode == 0, ran.stdout + ran.stderr
    results = [json.loads(line) for line in out.read_text().splitlines()]
    assert [r["custom_id"] for r in results] == [line["custom_id"] for line in lines]
    assert {r["status"] for r in results} == {"succeeded"}
