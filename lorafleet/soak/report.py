"""The soak's tables: checks, faults and recovery, per-minute traffic, memory."""

from __future__ import annotations

from typing import Any

from rich.console import Console
from rich.table import Table

from lorafleet.soak.run import SoakResult


def _cell(value: Any) -> str:
    return "-" if value is None else str(value)


def _table(title: str, rows: list[dict[str, Any]], columns: list[str]) -> Table:
    table = Table(title=title)
    for column in columns:
        table.add_column(column)
    for row in rows:
        table.add_row(*(_cell(row.get(column)) for column in columns))
    return table


def print_report(result: SoakResult, console: Console) -> None:
    verdict = result.verdict
    checks = Table(title="What was checked")
    checks.add_column("count")
    checks.add_column("n", justify="right")
    for name, n in sorted(verdict.counts.items()):
        checks.add_row(name, str(n))
    for name, n in sorted(verdict.refusals.items()):
        checks.add_row(f"refused: {name}", str(n))
    for name, n in sorted(verdict.job_errors.items()):
        checks.add_row(f"jobs failed: {name}", str(n))
    for attempts, n in sorted(verdict.attempts.items()):
        checks.add_row(f"finished jobs with {attempts} attempt(s)", str(n))
    console.print(checks)
    console.print(
        _table(
            "Faults: when, what was back (restored_s), when a request sent after it first "
            "succeeded (served_s), requests of the next minute that did not succeed (the "
            "rate-limited tenant's refusals left out)",
            result.faults,
            ["fault", "target", "at_s", "restored_s", "served_s", "next_minute_not_ok", "note"],
        )
    )
    console.print(
        _table(
            "Per minute (by when requests were sent; latency: send to result, succeeded only)",
            result.minutes,
            ["minute", "sent", "accepted", "refused", "no_answer", "succeeded", "p50_ms",
             "p95_ms", "ttft_p50_ms"],
        )
    )  # fmt: skip
    memory = result.memory
    console.print(
        f"Redis after the retention: used_memory {memory['used_memory_start'] / 2**20:.2f} -> "
        f"{memory['used_memory_end'] / 2**20:.2f} MiB, keys {memory['keys_start']} -> "
        f"{memory['keys_end']}; new keys left: {memory['new_keys'] or 'none'}"
    )
    console.print(
        _table(
            "Resident memory per process life (slope over its last three quarters)",
            sorted(result.rss, key=lambda r: (r["process"], r["role"])),
            ["process", "role", "pid", "life_s", "rss_start_mb", "rss_end_mb",
             "slope_mb_per_h"],
        )
    )  # fmt: skip
    if result.restarts:
        console.print(
            "Restarts by the supervisor: "
            + ", ".join(f"{name} at {at:.0f} s (exit {code})" for at, name, code in result.restarts)
        )
    if verdict.violations:
        console.print(f"[red]{len(verdict.violations)} violations:[/red]")
        for line in verdict.violations[:50]:
            console.print(f"  {line}")
    else:
        console.print("[green]No violations.[/green]")
