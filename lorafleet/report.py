"""Figures of a run, per tier: latency percentiles, residency, load phases, identity."""

from __future__ import annotations

from collections import Counter
from typing import Any

from rich.table import Table

from contracts.errors import ErrorCode
from contracts.jobs import JobPublic, JobStatus

LEVELS = ("gpu", "cpu", "disk", "remote", "unknown")
PHASES = ("fetch", "verify", "engine_load")


def percentile(values: list[float], q: float) -> float | None:
    """Nearest-rank percentile (``q`` in 0..100); ``None`` for no values."""
    if not values:
        return None
    ordered = sorted(values)
    rank = max(1, round(q / 100 * len(ordered)))
    return ordered[min(rank, len(ordered)) - 1]


def summarise(jobs: list[JobPublic], tiers: dict[str, str]) -> dict[str, Any]:
    """``{tier: figures}`` plus an ``all`` row; ``tiers`` maps alias -> tier."""
    groups: dict[str, list[JobPublic]] = {}
    for job in jobs:
        groups.setdefault(tiers[job.adapter], []).append(job)
    groups["all"] = list(jobs)
    return {tier: _figures(group) for tier, group in groups.items()}


def _figures(jobs: list[JobPublic]) -> dict[str, Any]:
    done = [job for job in jobs if job.metadata is not None]
    e2e = [job.metadata.e2e_ms for job in done if job.metadata]
    residency: Counter[str] = Counter(job.metadata.residency_before for job in done if job.metadata)
    phases: dict[str, dict[str, float | int | None]] = {}
    for phase in PHASES:
        values = [
            value
            for job in done
            if job.metadata and (value := getattr(job.metadata.load_ms, phase)) is not None
        ]
        phases[phase] = {
            "count": len(values),
            "p50_ms": percentile(values, 50),
            "max_ms": max(values) if values else None,
        }
    mismatched = sum(
        1
        for job in jobs
        if (job.metadata and not job.metadata.identity_verified)
        or (job.error and job.error.code == ErrorCode.ADAPTER_INTEGRITY)
    )
    return {
        "jobs": len(jobs),
        "succeeded": sum(1 for job in jobs if job.status == JobStatus.SUCCEEDED),
        "failed": sum(1 for job in jobs if job.status == JobStatus.FAILED),
        "e2e_p50_ms": percentile(e2e, 50),
        "e2e_p95_ms": percentile(e2e, 95),
        "residency_before": {level: residency.get(level, 0) for level in LEVELS},
        "load_ms": phases,
        "identity_verified": sum(
            1 for job in done if job.metadata and job.metadata.identity_verified
        ),
        "identity_mismatched": mismatched,
    }


def _ms(value: float | None) -> str:
    return "-" if value is None else f"{value:,.0f}"


def table(summary: dict[str, Any]) -> Table:
    """The per-tier table the demo prints (latencies and load phases in ms)."""
    out = Table(
        title="lorafleet: jobs per tier",
        caption="residency before the job (job counts); load phases: p50 ms over the jobs "
        "that ran the phase (count); identity: verified/mismatched",
    )
    columns = [
        "tier",
        "jobs",
        "ok",
        "failed",
        "e2e p50",
        "e2e p95",
        *LEVELS,
        *(f"{phase} p50 (n)" for phase in PHASES),
        "identity",
    ]
    for column in columns:
        out.add_column(column, justify="left" if column == "tier" else "right")
    for tier in [t for t in ("hot", "warm", "cold") if t in summary] + ["all"]:
        row = summary[tier]
        out.add_row(
            tier,
            str(row["jobs"]),
            str(row["succeeded"]),
            str(row["failed"]),
            _ms(row["e2e_p50_ms"]),
            _ms(row["e2e_p95_ms"]),
            *(str(row["residency_before"][level]) for level in LEVELS),
            *(
                f"{_ms(row['load_ms'][phase]['p50_ms'])} ({row['load_ms'][phase]['count']})"
                for phase in PHASES
            ),
            f"{row['identity_verified']}/{row['identity_mismatched']}",
        )
    return out
