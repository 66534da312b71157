"""What an experiment run writes: ``results.json`` (one ``Results``) and ``requests.jsonl``
(one ``RequestRecord`` per generated request). The report is rebuilt from these alone."""

from __future__ import annotations

from typing import Literal

from pydantic import BaseModel, Field

Outcome = Literal[
    "completed",  # answered with text, identity checked
    "failed",  # the job ended failed (its code says why)
    "refused",  # the gateway refused it (4xx/5xx with a code), nothing ran
    "timeout",  # no answer within the request timeout
    "cancelled",  # the job ended cancelled
    "dropped",  # the generator could not send it: its concurrency limit was reached
]
Residency = Literal["gpu", "cpu", "disk", "remote", "unknown"]
Trial = Literal["warmed", "reset"]
ProfileName = Literal["single", "uniform", "skewed", "reversal", "cold_swap"]

# Fewer samples than this and a percentile is flagged, not printed as a number.
MIN_SAMPLES = {"p50": 5, "p95": 20, "p99": 100}


class RequestRecord(BaseModel):
    """One generated request, sent or not: one line of ``requests.jsonl``."""

    cell: str
    trial: Trial
    profile: ProfileName
    repetition: int
    offered_rate: float = Field(description="requests per second the trial offered")
    seq: int = Field(description="position in the generated sequence")
    arrival_s: float = Field(description="scheduled send time, seconds from the run's start")
    adapter: str
    prompt_id: int
    input_bucket: int
    max_tokens: int
    sent_s: float | None = Field(description="actual send time; None when dropped")
    outcome: Outcome
    code: str | None = None
    ttft_ms: float | None = Field(default=None, description="send to first text, client side")
    e2e_ms: float | None = None
    job_id: str | None = None
    expected_revision: str
    revision: str | None = Field(
        default=None, description="revision the worker says it ran (its metadata)"
    )
    loaded_digest: str | None = Field(default=None, description="digest the worker loaded")
    identity_verified: bool | None = None
    identity_mismatch: bool = False
    residency_before: Residency | None = None
    prefetched: bool | None = Field(
        default=None, description="the worker says a prefetch put the adapter where it was"
    )
    load_ms: dict[str, float | None] = Field(default_factory=dict)
    queue_wait_ms: float | None = None
    completion_tokens: int | None = None


def mismatched(record: RequestRecord) -> bool:
    """A completed answer whose worker-side evidence does not show the expected revision,
    loaded from verified files (no evidence is a mismatch too, never a pass)."""
    if record.outcome != "completed":
        return False
    expected = record.expected_revision
    return record.identity_mismatch or not (
        record.revision == expected
        and record.loaded_digest == expected
        and record.identity_verified is True
    )


class Percentiles(BaseModel):
    """``p50``/``p95``/``p99`` in ms; a value is ``None`` where ``n`` is below its minimum
    sample count (``MIN_SAMPLES``), so a p99 of 12 samples is never shown as a number."""

    n: int
    p50: float | None
    p95: float | None
    p99: float | None


class Counts(BaseModel):
    planned: int
    sent: int
    dropped: int
    delayed: int = Field(description="sent later than scheduled by more than the lateness bound")
    accepted: int
    completed: int
    failed: int
    refused: int
    cancelled: int
    timeouts: int
    failed_loads: int
    identity_mismatches: int
    codes: dict[str, int] = Field(default_factory=dict)


class Sample(BaseModel):
    """A value observed over time: ``(seconds from the trial's start, value)``."""

    t: float
    value: float


class TrialResult(BaseModel):
    cell: str
    trial: Trial
    profile: ProfileName
    repetition: int
    offered_rate: float
    duration_s: float
    counts: Counts
    top1_share: float
    top10_share: float
    popular_before: str | None = None
    popular_after: str | None = None
    reversal_at_s: float | None = None
    throughput_rps: float
    ttft_ms: dict[str, Percentiles] = Field(description="per adapter")
    e2e_ms: dict[str, Percentiles] = Field(description="per adapter")
    ttft_by_residency: dict[str, Percentiles]
    load_ms: dict[str, Percentiles] = Field(description="per loading phase, as observed")
    queue_depth: list[Sample] = Field(default_factory=list)
    worker_rss_mb: list[Sample] = Field(default_factory=list)
    gpu_memory_mb: list[Sample] | None = Field(default=None, description="None: no GPU")
    worker_start_s: float | None = Field(
        default=None,
        description="reset trials: how long the worker's start before the trial took, until "
        "it announced itself (a popularity warm-up included)",
    )
    prefetches: dict[str, float] = Field(
        default_factory=dict,
        description="the worker's adapter prefetches during the trial by outcome (started, "
        "disk, cpu, used, wasted, failed; every trigger), where its metrics were read (local "
        "runs)",
    )
    budget_violations: list[str] = Field(default_factory=list)


class CellConfig(BaseModel):
    max_loras: int
    max_cpu_loras: int
    max_lora_rank: int


class Startup(BaseModel):
    outcome: Literal["started", "rejected", "timeout", "assumed"] = Field(
        description="rejected: the worker or its engine exited refusing the configuration; "
        "timeout: it did not announce itself in time; assumed: a deployment, not started here"
    )
    seconds: float | None = None
    error: str | None = Field(default=None, description="the engine's (or worker's) own error")


class CellResult(BaseModel):
    id: str
    sweep: str = Field(description="which sweep the cell belongs to")
    config: CellConfig
    startup: Startup
    trials: list[TrialResult] = Field(default_factory=list)
    stopped: str | None = Field(
        default=None,
        description="why the cell's remaining trials did not run (a worker that exited, a "
        "restart or warm-up that failed); None: every trial ran",
    )


class DecisionRow(BaseModel):
    condition: str
    evidence: str
    decision: str
    holds: bool | None = Field(description="None: not evaluated (a gate before it decided)")


class Decision(BaseModel):
    verdict: str
    because: list[str]
    table: list[DecisionRow]
    admission_limits: dict[str, float] | None = None
    isolate: list[str] = Field(default_factory=list)


class Results(BaseModel):
    experiment_id: str
    mode: Literal["local", "remote"]
    started_at: str
    finished_at: str
    manifest: dict[str, object]
    reset_procedure: str = Field(description="the reset this run performed before reset trials")
    not_reset: list[str] = Field(description="what the reset procedure cannot reset")
    cells: list[CellResult]
    baseline: CellResult | None = Field(
        default=None,
        description="the cold-swap baseline (one PEFT model object, adapter swapped in place) "
        "on the same generated sequences; never part of the decision",
    )
    decision: Decision
