"""The churn experiment by hand: the local manifest, run end to end, its decision and tables.

    .venv/bin/python benchmarks/churn.py --out churn-out [--adapters 12 --requests 120
        --rates 4,16] [--slots-only]

It writes the manifest with ``lorafleet experiment template --local`` (12 fixture adapters,
so the working set exceeds the CPU cache of every cell) and its full sweep (``--slots-only``:
only the first sweep, max_loras 1 and 2 at CPU capacity 4, about half the time), runs
``lorafleet experiment run`` (its progress bar shows), then prints, from ``results.json``:
the decision, one row per cell x trial kind x profile x rate, and lorafleet against the
cold-swap baseline on the skewed profile. Everything shares this machine's cores: the
generator, gateway, Redis, S3, the worker and its engine (or the baseline server).
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
from pathlib import Path

import yaml
from rich.console import Console
from rich.table import Table

from lorafleet.experiment.analysis import ok, percentiles
from lorafleet.experiment.report import load

SLOTS_ONLY = {
    "max_loras": [1, 2],
    "max_cpu_loras": [4],
    "max_lora_rank": [8],
    "cpu_capacity": None,
}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--adapters", type=int, default=12)
    parser.add_argument("--requests", type=int, default=120, help="requests per trial")
    parser.add_argument("--rates", default="4,16", help="offered rates, req/s")
    parser.add_argument("--slots-only", action="store_true", help="only the first sweep")
    args = parser.parse_args()
    console = Console(width=160)
    lorafleet = [sys.executable, "-m", "lorafleet"]
    local = ["--local", "--adapters", str(args.adapters), "--requests", str(args.requests)]
    template = subprocess.run(
        [*lorafleet, "experiment", "template", *local],
        capture_output=True,
        text=True,
        check=True,
    )
    manifest = yaml.safe_load(template.stdout)
    manifest["offered_rates"] = [float(rate) for rate in args.rates.split(",")]
    if args.slots_only:
        manifest["sweeps"] = SLOTS_ONLY
    manifest["acceptance"]["default"] = {"ttft_p95_ms": 1000.0, "max_failure_rate": 0.0}
    args.out.parent.mkdir(parents=True, exist_ok=True)
    path = args.out.with_suffix(".manifest.yaml")
    path.write_text(yaml.safe_dump(manifest, sort_keys=False))
    console.print(f"manifest: {path}")
    run = subprocess.run(
        [*lorafleet, "experiment", "run", str(path), "--out", str(args.out)], env=os.environ
    )
    if run.returncode not in (0, 1):
        sys.exit(run.returncode)
    summarise(args.out, console)


def summarise(out: Path, console: Console) -> None:
    results, requests = load(out)
    console.print(f"[bold]decision: {results.decision.verdict}[/]")
    for reason in results.decision.because:
        console.print(f"  because: {reason}")
    view = Table(title="cells (TTFT from send to first text, ms; client side)")
    for column in ("cell", "trial", "profile", "req/s offered", "done/planned", "dropped"):
        view.add_column(column)
    for column in ("TTFT p50", "TTFT p95", "p95 remote/disk", "top1", "misses"):
        view.add_column(column)
    for cell in results.cells:
        if not cell.trials:
            view.add_row(cell.id, "-", "-", "-", "-", "-", "-", "-", "-", "-", cell.startup.outcome)
        for t in cell.trials:
            mine = [
                r
                for r in requests
                if (r.cell, r.trial, r.profile, r.offered_rate, r.repetition)
                == (t.cell, t.trial, t.profile, t.offered_rate, t.repetition)
            ]
            done = [r.ttft_ms for r in mine if ok(r) and r.ttft_ms is not None]
            cold = [
                r.ttft_ms
                for r in mine
                if r.residency_before in ("remote", "disk") and r.ttft_ms is not None
            ]
            all_p, cold_p = percentiles(done), percentiles(cold)
            view.add_row(
                t.cell,
                t.trial,
                t.profile,
                f"{t.offered_rate:g}",
                f"{t.counts.completed}/{t.counts.planned}",
                str(t.counts.dropped),
                _ms(all_p.p50),
                _ms(all_p.p95),
                f"{_ms(cold_p.p95)} (n={cold_p.n})",
                f"{t.top1_share:.0%}",
                str(len(t.budget_violations)),
            )
    console.print(view)
    if results.baseline is None:
        return
    versus = Table(title="lorafleet vs the cold-swap baseline, same sequences (warmed trials)")
    for column in ("server", "profile", "req/s offered", "done/planned", "req/s"):
        versus.add_column(column)
    for column in ("TTFT p50", "TTFT p95"):
        versus.add_column(column)
    for base in results.baseline.trials:
        rows = [
            t
            for cell in results.cells
            for t in cell.trials
            if (t.trial, t.profile, t.offered_rate) == ("warmed", base.profile, base.offered_rate)
        ]
        for t in [*rows, base]:
            mine = [
                r.ttft_ms
                for r in requests
                if (r.cell, r.trial, r.profile, r.offered_rate)
                == (t.cell, t.trial, t.profile, t.offered_rate)
                and ok(r)
                and r.ttft_ms is not None
            ]
            p = percentiles(mine)
            versus.add_row(
                t.cell,
                t.profile,
                f"{t.offered_rate:g}",
                f"{t.counts.completed}/{t.counts.planned}",
                f"{t.throughput_rps:.2f}",
                _ms(p.p50),
                _ms(p.p95),
            )
    console.print(versus)
    console.print(f"report: {out / 'report.html'}")


def _ms(value: float | None) -> str:
    return "too few" if value is None else f"{value:.0f}"


if __name__ == "__main__":
    main()
