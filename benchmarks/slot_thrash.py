"""The adapter-slot thrash: engine adapter loads per job with more distinct adapters than slots.

A worker with ``max_loras`` GPU slots and ``max_cpu_loras`` CPU slots takes a batch of jobs
spread over more distinct adapters than either. vLLM logs (at DEBUG) each activation of an
adapter into a GPU slot ("Activating LoRA") and each adapter it adds to its CPU cache, read
from disk ("Adding lora"); this counts both per job, for a worker running the code of
``--before`` (a git revision, checked out in a temporary worktree) and for this checkout's,
alternating A B A B in one run with the same gateway, Redis, S3 and jobs.

    .venv/bin/python benchmarks/slot_thrash.py --before HEAD~1 [--jobs 240 --adapters 8]
        [--rate 4]   (jobs arriving one by one while others run, instead of one batch)

The CPU is shared: client, gateway, Redis, worker and engine run on the same 2 cores.
"""

from __future__ import annotations

import argparse
import json
import random
import shutil
import statistics
import subprocess
import tempfile
import time
from pathlib import Path
from typing import Any

import httpx
from rich.console import Console
from rich.table import Table

from contracts.queues import Tier
from lorafleet.client import auth_headers
from lorafleet.fixtures import write_fixtures
from lorafleet.settings import LocalSettings
from lorafleet.stack import LocalStack

REPO = Path(__file__).resolve().parents[1]
ACTIVATED = "Activating LoRA"
ADDED = "Adding lora"


def worktree(revision: str, scratch: Path) -> Path:
    path = scratch / "before"
    subprocess.run(
        ["git", "-C", str(REPO), "worktree", "add", "--detach", str(path), revision],
        check=True,
        capture_output=True,
    )
    return path


def count(log: Path, start: int) -> tuple[int, int]:
    """Activations and CPU-cache adds the engine logged after byte ``start`` of ``log``."""
    with log.open("rb") as handle:
        handle.seek(start)
        text = handle.read().decode(errors="replace")
    return text.count(ACTIVATED), text.count(ADDED)


def _sampling(new_tokens: int) -> dict[str, Any]:
    return {"max_tokens": new_tokens, "temperature": 0.0, "ignore_eos": True}


def _summary(jobs: list[dict[str, Any]], wall_s: float) -> dict[str, Any]:
    e2e = sorted(job["metadata"]["e2e_ms"] for job in jobs if job["status"] == "succeeded")
    return {
        "wall_s": wall_s,
        "failed": sum(job["status"] != "succeeded" for job in jobs),
        "e2e_p50": statistics.median(e2e) if e2e else float("nan"),
        "e2e_p95": e2e[int(0.95 * (len(e2e) - 1))] if e2e else float("nan"),
    }


def run_batch(
    http: httpx.Client, work: list[tuple[str, str]], new_tokens: int, console: Console
) -> dict[str, Any]:
    """Every job at once, as one batch."""
    requests = [
        {"custom_id": str(n), "adapter": alias, "prompt": prompt, "sampling": _sampling(new_tokens)}
        for n, (alias, prompt) in enumerate(work)
    ]
    start = time.perf_counter()
    batch = http.post("/v1/batches", json={"requests": requests})
    batch.raise_for_status()
    batch_id = batch.json()["id"]
    while True:
        state = http.get(f"/v1/batches/{batch_id}").json()
        console.print(f"  {state['request_counts']}", end="\r")
        if state["status"] in {"completed", "cancelled"}:
            break
        time.sleep(0.5)
    wall_s = time.perf_counter() - start
    console.print()
    lines = http.get(f"/v1/batches/{batch_id}/results").text.splitlines()
    return _summary([json.loads(line) for line in lines], wall_s)


def run_open_loop(
    http: httpx.Client,
    work: list[tuple[str, str]],
    new_tokens: int,
    rate: float,
    console: Console,
) -> dict[str, Any]:
    """Jobs arriving one by one at Poisson times (``rate`` a second), whatever is running."""
    rng = random.Random(11)
    start = time.perf_counter()
    due = start
    ids = []
    for n, (alias, prompt) in enumerate(work, 1):
        due += rng.expovariate(rate)
        time.sleep(max(0.0, due - time.perf_counter()))
        body = {"adapter": alias, "prompt": prompt, "sampling": _sampling(new_tokens)}
        response = http.post("/v1/jobs", json=body)
        response.raise_for_status()
        ids.append(response.json()["id"])
        console.print(f"  submitted {n}/{len(work)}", end="\r")
    jobs = []
    for job_id in ids:
        while True:
            job = http.get(f"/v1/jobs/{job_id}", params={"wait_s": 20}).json()
            if job["status"] in {"succeeded", "failed", "cancelled"}:
                jobs.append(job)
                break
    wall_s = time.perf_counter() - start
    console.print()
    return _summary(jobs, wall_s)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--before", required=True, help="git revision of the 'before' worker")
    parser.add_argument("--jobs", type=int, default=240)
    parser.add_argument("--adapters", type=int, default=8)
    parser.add_argument("--max-loras", type=int, default=2)
    parser.add_argument("--max-cpu-loras", type=int, default=4)
    parser.add_argument("--new-tokens", type=int, default=32)
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument(
        "--rate",
        type=float,
        default=0.0,
        help="jobs a second, arriving one by one (Poisson); 0: all at once as one batch",
    )
    args = parser.parse_args()
    console = Console(width=140)
    scratch = Path(tempfile.mkdtemp(prefix="lorafleet-thrash-"))
    before = worktree(args.before, scratch)
    arms: dict[str, dict[str, str]] = {
        "before": {"PYTHONPATH": str(before)},
        "after": {},
    }
    results: dict[str, list[dict[str, Any]]] = {label: [] for label in arms}
    try:
        specs = write_fixtures(scratch / "fixtures", adapters=args.adapters)
        model = scratch / "fixtures" / "base"
        rng = random.Random(7)
        names = [spec.name for spec in specs]
        work = [(rng.choice(names), f"Question {n}: say something.") for n in range(args.jobs)]
        engine_env = {
            "LORAFLEET_MAX_LORAS": str(args.max_loras),
            "LORAFLEET_MAX_CPU_LORAS": str(args.max_cpu_loras),
            "VLLM_LOGGING_LEVEL": "DEBUG",
        }
        settings = LocalSettings(state_dir=scratch / "state")
        with LocalStack(settings, model) as stack:
            stack.start_infra()
            publisher = stack.publisher()
            for spec in specs:
                publisher.publish(
                    scratch / "fixtures" / "adapters" / spec.name, spec.name, Tier.COLD
                )
            stack.start_gateway()
            http = httpx.Client(
                base_url=stack.gateway_url, headers=auth_headers(stack.api_key), timeout=60
            )
            for round_ in range(args.rounds):
                for n, (label, arm_env) in enumerate(arms.items()):
                    console.print(f"round {round_ + 1}: worker of {label}")
                    name = f"worker-{n}-{round_}"
                    worker = stack.spawn_worker({**engine_env, **arm_env}, name=name)
                    stack.wait_worker(worker)
                    log = stack.log_dir / f"{name}.log"
                    mark = log.stat().st_size
                    if args.rate > 0:
                        outcome = run_open_loop(http, work, args.new_tokens, args.rate, console)
                    else:
                        outcome = run_batch(http, work, args.new_tokens, console)
                    outcome["activations"], outcome["adds"] = count(log, mark)
                    results[label].append(outcome)
                    stack.stop_child(worker)
                    shutil.rmtree(stack.state_dir / "cache", ignore_errors=True)
    finally:
        subprocess.run(
            ["git", "-C", str(REPO), "worktree", "remove", "--force", str(before)],
            capture_output=True,
        )
        shutil.rmtree(scratch, ignore_errors=True)

    table = Table(
        title=f"{args.jobs} jobs x {args.new_tokens} tokens over {args.adapters} adapters, "
        f"max_loras {args.max_loras}, max_cpu_loras {args.max_cpu_loras}; "
        f"before = {args.before}, {args.rounds} rounds A B; "
        + (f"Poisson arrivals at {args.rate}/s" if args.rate > 0 else "one batch")
    )
    for column in (
        "worker",
        "round",
        "failed",
        "GPU-slot activations/job",
        "CPU-cache adds/job",
        "jobs/s",
        "e2e p50 ms",
        "e2e p95 ms",
    ):
        table.add_column(column, justify="left" if column == "worker" else "right")
    for label, outcomes in results.items():
        for n, outcome in enumerate(outcomes, 1):
            table.add_row(
                label,
                str(n),
                str(outcome["failed"]),
                f"{outcome['activations'] / args.jobs:.2f}",
                f"{outcome['adds'] / args.jobs:.2f}",
                f"{args.jobs / outcome['wall_s']:.1f}",
                f"{outcome['e2e_p50']:.0f}",
                f"{outcome['e2e_p95']:.0f}",
            )
    console.print(table)
    ratio = statistics.median(o["activations"] for o in results["after"]) / max(
        1, statistics.median(o["activations"] for o in results["before"])
    )
    console.print(f"activations after / before (median of rounds): {ratio:.2f}x")


if __name__ == "__main__":
    main()
