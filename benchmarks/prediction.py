"""Prediction off, look-ahead only, look-ahead + popularity: the churn experiment's same
generated request sequences (skewed and popularity-reversal profiles) run once per arm, one
after the other in one invocation, and compared side by side.

    .venv/bin/python benchmarks/prediction.py --out prediction-out [--requests 300
        --rates 8,16 --worker-concurrency 4 --arms off,lookahead,popularity,popularity:12
        --profiles skewed,reversal --trials warmed,reset --rounds 1 --store-delay-ms 300]

An arm is a ``LORAFLEET_PREDICTION`` value; ``popularity:N`` also sets
``LORAFLEET_POPULARITY_PREFETCH=N``. ``--rounds 2`` runs the arms in turn twice (A B A B) and
pools each arm's rounds. ``--store-delay-ms`` puts ``slow_store.py`` between the stack and
its moto server (every S3 read held back that long: a simulated distance to the store, since
a fixture adapter is fetched from this machine's memory in ~30 ms where a real one takes
hundreds of milliseconds); 0 runs moto directly.

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
fetches from S3 per minute (jobs that timed a fetch), and the worker's prefetches started, used
and wasted during the trials (its ``lorafleet_adapter_prefetches_total``, read by the
experiment). Everything shares this machine's two cores: generator, gateway, Redis, S3, worker
and engine.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import math
import os
import subprocess
import sys
from collections import Counter
from collections.abc import Iterator
from pathlib import Path

import yaml
from rich.console import Console
from rich.table import Table

from lorafleet.experiment.analysis import ok
from lorafleet.experiment.report import load
from lorafleet.experiment.results import RequestRecord, Results
from lorafleet.processes import free_port, wait_until
from lorafleet.stack import LOCAL_AWS, s3_client

ARMS = ("off", "lookahead", "popularity")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--adapters", type=int, default=12)
    parser.add_argument("--requests", type=int, default=300, help="requests per trial")
    parser.add_argument("--rates", default="8,16", help="offered rates, req/s")
    parser.add_argument("--worker-concurrency", type=int, default=4)
    parser.add_argument("--arms", default=",".join(ARMS))
    parser.add_argument("--profiles", default="skewed,reversal")
    parser.add_argument("--trials", default="warmed,reset")
    parser.add_argument(
        "--rounds", type=int, default=1, help="the arms in turn this many times (A B A B)"
    )
    parser.add_argument(
        "--store-delay-ms",
        type=float,
        default=0.0,
        help="hold back each S3 read this long (benchmarks/slow_store.py in front of moto): "
        "what a real adapter's fetch costs; 0: moto on this machine, ~30 ms a fetch",
    )
    args = parser.parse_args()
    console = Console(width=170)
    lorafleet = [sys.executable, "-m", "lorafleet"]
    local = ["--local", "--adapters", str(args.adapters), "--requests", str(args.requests)]
    template = subprocess.run(
        [*lorafleet, "experiment", "template", *local], capture_output=True, text=True, check=True
    )
    manifest = yaml.safe_load(template.stdout)
    manifest["offered_rates"] = [float(rate) for rate in args.rates.split(",")]
    manifest["traffic_profiles"] = args.profiles.split(",")
    manifest["trials"] = args.trials.split(",")
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
        _arm_env(arm)  # refused before anything starts
    runs: list[tuple[str, Path]] = []
    with contextlib.ExitStack() as services:
        store_env = {}
        if args.store_delay_ms:
            store_env = services.enter_context(_slow_store(args.out, args.store_delay_ms))
            console.print(f"S3 reads held back {args.store_delay_ms:.0f} ms each: {store_env}")
        for round_ in range(1, args.rounds + 1):
            for arm in arms:
                name = arm if args.rounds == 1 else f"{arm}.r{round_}"
                console.rule(f"arm: LORAFLEET_PREDICTION={arm} (round {round_})")
                env = {
                    **os.environ,
                    **store_env,
                    "LORAFLEET_WORKER_CONCURRENCY": str(args.worker_concurrency),
                    **_arm_env(arm),
                }
                command = [
                    *lorafleet,
                    "experiment",
                    "run",
                    str(path),
                    "--out",
                    str(args.out / name),
                ]
                run = subprocess.run(command, env=env)
                if run.returncode not in (0, 1):
                    sys.exit(run.returncode)
                runs.append((arm, args.out / name))
    summary = summarise(runs, args.profiles.split(","), args.trials.split(","), console)
    summary["store_delay_ms"] = args.store_delay_ms
    (args.out / "summary.json").write_text(json.dumps(summary, indent=2))


def _arm_env(arm: str) -> dict[str, str]:
    """``off``, ``lookahead``, ``popularity``, or ``popularity:N`` (the pool's N most
    asked-for adapters prefetched, ``LORAFLEET_POPULARITY_PREFETCH``)."""
    prediction, _, top = arm.partition(":")
    if prediction not in ARMS or (top and prediction != "popularity"):
        raise SystemExit(f"unknown arm {arm!r}: one of {', '.join(ARMS)}, or popularity:N")
    env = {"LORAFLEET_PREDICTION": prediction}
    if top:
        env["LORAFLEET_POPULARITY_PREFETCH"] = str(int(top))
    return env


@contextlib.contextmanager
def _slow_store(out: Path, delay_ms: float) -> Iterator[dict[str, str]]:
    """moto's S3 server behind ``slow_store.py``; the environment that points a stack at it."""
    moto_port = free_port()
    logs = (out / "moto.log").open("ab")
    moto = subprocess.Popen(
        [sys.executable, "-m", "moto.server", "-H", "127.0.0.1", "-p", str(moto_port)],
        env={**os.environ, **LOCAL_AWS},
        stdout=logs,
        stderr=subprocess.STDOUT,
    )
    proxy = subprocess.Popen(
        [
            sys.executable,
            str(Path(__file__).with_name("slow_store.py")),
            "--upstream",
            f"127.0.0.1:{moto_port}",
            "--delay-ms",
            str(delay_ms),
        ],
        stdout=subprocess.PIPE,
        text=True,
    )
    try:
        assert proxy.stdout is not None
        port = int(proxy.stdout.readline())
        endpoint = f"http://127.0.0.1:{port}"
        wait_until(
            lambda: s3_client(endpoint, "us-east-1", local=True).list_buckets() is not None,
            60,
            "moto behind the slow store",
        )
        yield {"LORAFLEET_S3_ENDPOINT_URL": endpoint, **LOCAL_AWS}
    finally:
        for child in (proxy, moto):
            child.terminate()
            child.wait(30)
        logs.close()


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


def summarise(
    runs: list[tuple[str, Path]], profiles: list[str], trials: list[str], console: Console
) -> dict[str, object]:
    """One row per arm, profile and trial (and both trials), every round of an arm pooled."""
    table = Table(title="prediction arms, same sequences (TTFT ms, client side; n in brackets)")
    for column in ("arm", "profile", "trial", "done", "hit ratio", "prefetched"):
        table.add_column(column)
    for column in ("popular p50/p95", "tail p50/p95/p99", "S3 fetches/min"):
        table.add_column(column)
    table.add_column("prefetches started/used/wasted")
    table.add_column("worker start s")
    loaded = [(arm, *load(out)) for arm, out in runs]
    summary: dict[str, object] = {}
    for arm in dict.fromkeys(arm for arm, _ in runs):
        for profile in profiles:
            for trial in [*trials, "both"] if len(trials) > 1 else trials:
                groups: dict[tuple[int, str, float], list[RequestRecord]] = {}
                prefetches: Counter[str] = Counter()
                starts: list[float] = []
                for index, (name, results, requests) in enumerate(loaded):
                    if name != arm:
                        continue
                    for r in requests:
                        if r.profile == profile and trial in (r.trial, "both"):
                            groups.setdefault((index, r.trial, r.offered_rate), []).append(r)
                    prefetches.update(_prefetches(results, profile, trial))
                    starts += [
                        t.worker_start_s
                        for cell in results.cells
                        for t in cell.trials
                        if t.profile == profile
                        and trial in (t.trial, "both")
                        and t.worker_start_s is not None
                    ]
                row = _row(list(groups.values()))
                row["prefetches"] = dict(prefetches)
                row["worker_start_s"] = starts
                summary[f"{arm}/{profile}/{trial}"] = row
                table.add_row(
                    arm,
                    profile,
                    trial,
                    f"{row['done']}/{row['planned']}",
                    _share(row["hit_ratio"]),
                    _share(row["prefetched"]),
                    "/".join(_ms(v) for v in row["popular"]) + f" ({row['popular_n']})",  # type: ignore[attr-defined]
                    "/".join(_ms(v) for v in row["tail"]) + f" ({row['tail_n']})",  # type: ignore[attr-defined]
                    _ms(row["fetches_per_min"], 1),  # type: ignore[arg-type]
                    "/".join(f"{prefetches[o]:.0f}" for o in ("started", "used", "wasted")),
                    _ms(_nearest(starts, 50), 1),
                )
    console.print(table)
    return summary


def _prefetches(results: Results, profile: str, trial: str) -> Counter[str]:
    """The worker's prefetches by outcome during the trials of ``profile`` and ``trial``."""
    counts: Counter[str] = Counter()
    for cell in results.cells:
        for t in cell.trials:
            if t.profile == profile and trial in (t.trial, "both"):
                counts.update(t.prefetches)
    return counts


def _row(groups: list[list[RequestRecord]]) -> dict[str, object]:
    popular: list[float] = []
    tail: list[float] = []
    done = hits = prefetched = fetches = planned = 0
    minutes = 0.0
    for records in groups:
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
    return {
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


def _ms(value: float | None, digits: int = 0) -> str:
    return "-" if value is None else f"{value:.{digits}f}"


def _share(value: object) -> str:
    return "-" if value is None else f"{float(value):.0%}"  # type: ignore[arg-type]


if __name__ == "__main__":
    main()
