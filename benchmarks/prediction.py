"""Prediction off, look-ahead only, look-ahead + popularity: the churn experiment's same
generated request sequences (skewed and popularity-reversal profiles) run once per arm, one
after the other in one invocation, and compared side by side.

    .venv/bin/python benchmarks/prediction.py --out prediction-out [--requests 300
        --rates 8,16 --worker-concurrency 4 --arms off,lookahead,popularity]

Each arm is ``lorafleet experiment run`` of the same manifest (``template --local``: 12
fixture adapters cold in S3, one cell max_loras 2 / max_cpu_loras 4, warmed and reset trials)
with the worker's ``LORAFLEET_PREDICTION`` set to the arm; every arm starts its own stack
(fresh Redis: the popularity counts of an arm are gathered during its own trials, and a reset
trial's restarted worker warms up from them). ``--worker-concurrency`` bounds the jobs a
worker takes at once, so that jobs wait in Redis where the look-ahead sees them (with the
default 256 a worker takes every job at once and the look-ahead has nothing to read).

Per arm and profile it prints: the hit ratio at arrival (the adapter in the engine: `gpu` or
`cpu`), the share of jobs that found their adapter where a prefetch put it, TTFT p50/p95/p99
(client side, send to first text) of the popular adapter (the most requested one of each
half of the trial: the reversal swaps it) and of the long tail (every other adapter), and
fetches from S3 per minute (jobs that timed a fetch). Everything shares this machine's two
cores: generator, gateway, Redis, S3, worker and engine.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import subprocess
import sys
from collections import Counter
from pathlib import Path

import yaml
from rich.console import Console
from rich.table import Table

from lorafleet.experiment.analysis import ok
from lorafleet.experiment.report import load
from lorafleet.experiment.results import RequestRecord

ARMS = ("off", "lookahead", "popularity")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--adapters", type=int, default=12)
    parser.add_argument("--requests", type=int, default=300, help="requests per trial")
    parser.add_argument("--rates", default="8,16", help="offered rates, req/s")
    parser.add_argument("--worker-concurrency", type=int, default=4)
    parser.add_argument("--arms", default=",".join(ARMS))
    args = parser.parse_args()
    console = Console(width=170)
    lorafleet = [sys.executable, "-m", "lorafleet"]
    local = ["--local", "--adapters", str(args.adapters), "--requests", str(args.requests)]
    template = subprocess.run(
        [*lorafleet, "experiment", "template", *local], capture_output=True, text=True, check=True
    )
    manifest = yaml.safe_load(template.stdout)
    manifest["offered_rates"] = [float(rate) for rate in args.rates.split(",")]
    manifest["traffic_profiles"] = ["skewed", "reversal"]
    manifest["trials"] = ["warmed", "reset"]
    manifest["repetitions"] = 1
    manifest["cold_swap_baseline"] = []
    manifest["sweeps"] = {
        "max_loras": [2],
        "max_cpu_loras": [4],
        "max_lora_rank": [8],
        "cpu_capacity": None,
    }
    manifest["acceptance"]["default"] = {"ttft_p95_ms": 1000.0, "max_failure_rate": 0.0}
    args.out.mkdir(parents=True, exist_ok=True)
    path = args.out / "manifest.yaml"
    path.write_text(yaml.safe_dump(manifest, sort_keys=False))
    console.print(f"manifest: {path}")
    arms = args.arms.split(",")
    for arm in arms:
        console.rule(f"arm: LORAFLEET_PREDICTION={arm}")
        env = {
            **os.environ,
            "LORAFLEET_PREDICTION": arm,
            "LORAFLEET_WORKER_CONCURRENCY": str(args.worker_concurrency),
        }
        run = subprocess.run(
            [*lorafleet, "experiment", "run", str(path), "--out", str(args.out / arm)], env=env
        )
        if run.returncode not in (0, 1):
            sys.exit(run.returncode)
    summary = summarise(args.out, arms, console)
    (args.out / "summary.json").write_text(json.dumps(summary, indent=2))


def _nearest(values: list[float], q: float) -> float | None:
    if not values:
        return None
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, max(0, math.ceil(q / 100 * len(ordered)) - 1))]


def _popular(records: list[RequestRecord]) -> set[tuple[int, str]]:
    """(half, adapter) of the most requested adapter of each half of a trial."""
    half = (max(r.seq for r in records) + 1) / 2
    out = set()
    for which in (0, 1):
        part = Counter(r.adapter for r in records if (r.seq >= half) == bool(which))
        if part:
            out.add((which, part.most_common(1)[0][0]))
    return out


def summarise(out: Path, arms: list[str], console: Console) -> dict[str, object]:
    table = Table(title="prediction arms, same sequences (TTFT ms, client side; n in brackets)")
    for column in ("arm", "profile", "trial", "done", "hit ratio", "prefetched"):
        table.add_column(column)
    for column in ("popular p50/p95", "tail p50/p95/p99", "S3 fetches/min"):
        table.add_column(column)
    summary: dict[str, object] = {}
    for arm in arms:
        _, requests = load(out / arm)
        for profile in ("skewed", "reversal"):
            for trial in ("warmed", "reset", "both"):
                groups: dict[tuple[str, float], list[RequestRecord]] = {}
                for r in requests:
                    if r.profile == profile and trial in (r.trial, "both"):
                        groups.setdefault((r.trial, r.offered_rate), []).append(r)
                popular: list[float] = []
                tail: list[float] = []
                done = hits = prefetched = fetches = planned = 0
                minutes = 0.0
                for records in groups.values():
                    top = _popular(records)
                    half = (max(r.seq for r in records) + 1) / 2
                    planned += len(records)
                    minutes += max(r.arrival_s for r in records) / 60 if records else 0
                    for r in records:
                        if not ok(r) or r.ttft_ms is None:
                            continue
                        done += 1
                        hits += r.residency_before in ("gpu", "cpu")
                        prefetched += bool(r.prefetched)
                        fetches += r.load_ms.get("fetch") is not None
                        is_popular = (int(r.seq >= half), r.adapter) in top
                        (popular if is_popular else tail).append(r.ttft_ms)
                row = {
                    "done": done,
                    "planned": planned,
                    "hit_ratio": hits / done if done else None,
                    "prefetched": prefetched / done if done else None,
                    "popular": [_nearest(popular, q) for q in (50, 95)],
                    "popular_n": len(popular),
                    "tail": [_nearest(tail, q) for q in (50, 95, 99)],
                    "tail_n": len(tail),
                    "fetches_per_min": fetches / minutes if minutes else None,
                }
                summary[f"{arm}/{profile}/{trial}"] = row
                table.add_row(
                    arm,
                    profile,
                    trial,
                    f"{done}/{planned}",
                    _share(row["hit_ratio"]),
                    _share(row["prefetched"]),
                    "/".join(_ms(v) for v in row["popular"]) + f" ({len(popular)})",  # type: ignore[attr-defined]
                    "/".join(_ms(v) for v in row["tail"]) + f" ({len(tail)})",  # type: ignore[attr-defined]
                    "-" if not minutes else f"{fetches / minutes:.1f}",
                )
    console.print(table)
    return summary


def _ms(value: float | None) -> str:
    return "-" if value is None else f"{value:.0f}"


def _share(value: object) -> str:
    return "-" if value is None else f"{float(value):.0%}"  # type: ignore[arg-type]


if __name__ == "__main__":
    main()
