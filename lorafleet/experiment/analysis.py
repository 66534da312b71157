"""From request records to per-trial figures, budget checks and the share-versus-isolate
decision. Pure functions: the report and the tests call them on recorded data."""

from __future__ import annotations

from collections import Counter, defaultdict
from collections.abc import Iterable

from lorafleet.experiment.drive import LOAD_FAILURES, Driven, TrialContext, is_delayed
from lorafleet.experiment.manifest import Manifest
from lorafleet.experiment.results import (
    MIN_SAMPLES,
    CellResult,
    Counts,
    Decision,
    DecisionRow,
    Percentiles,
    RequestRecord,
    TrialResult,
    mismatched,
)
from lorafleet.experiment.traffic import Plan
from lorafleet.report import percentile

STOP = "Stop rollout; fix routing before capacity tuning"
CANDIDATE = "Candidate for a shared pool"
LIMITED = "Share only with measured admission limits"
ISOLATE_RARE = "Warm a dedicated pool or isolate that class"
ISOLATE_BOUNDARY = "Isolate approved variants"
NOT_SHARED = "Do not share at the tested settings"
NOTHING_RAN = "No decision: no configuration started"
INSUFFICIENT = "No decision: not enough evidence"
TRIAL_KINDS = ("warmed", "reset")
# A miss "correlates with loading" when the adapter was not on the GPU and a load phase was
# observed, "with queueing" when the job waited at least this share of the budget in queue.
QUEUEING_SHARE = 0.5


def percentiles(values: Iterable[float]) -> Percentiles:
    data = list(values)
    shown = {
        name: round(nearest, 3)
        if len(data) >= least and (nearest := percentile(data, float(name[1:]))) is not None
        else None
        for name, least in MIN_SAMPLES.items()
    }
    return Percentiles(n=len(data), **shown)


def _by(records: Iterable[RequestRecord], key: str, value: str) -> dict[str, Percentiles]:
    groups: dict[str, list[float]] = defaultdict(list)
    for record in records:
        measured = getattr(record, value)
        if measured is not None:
            groups[str(getattr(record, key))].append(measured)
    return {name: percentiles(values) for name, values in sorted(groups.items())}


def ok(record: RequestRecord) -> bool:
    """Answered, with evidence that the expected revision ran."""
    return record.outcome == "completed" and not mismatched(record)


def counts(records: list[RequestRecord]) -> Counts:
    outcomes = Counter(record.outcome for record in records)
    return Counts(
        planned=len(records),
        sent=sum(record.sent_s is not None for record in records),
        dropped=outcomes["dropped"],
        delayed=sum(is_delayed(record) for record in records),
        accepted=sum(
            record.job_id is not None and record.outcome not in ("refused", "dropped")
            for record in records
        ),
        completed=outcomes["completed"],
        failed=outcomes["failed"],
        refused=outcomes["refused"],
        cancelled=outcomes["cancelled"],
        timeouts=outcomes["timeout"],
        failed_loads=sum(record.code in LOAD_FAILURES for record in records),
        identity_mismatches=sum(mismatched(record) for record in records),
        codes=dict(Counter(record.code for record in records if record.code)),
    )


def violations(manifest: Manifest, records: list[RequestRecord]) -> list[str]:
    """Per-adapter budget checks. With too few samples for a p95, every sample must be within
    the budget (the p95 of a handful of samples is their maximum anyway)."""
    found = []
    by_adapter: dict[str, list[RequestRecord]] = defaultdict(list)
    for record in records:
        by_adapter[record.adapter].append(record)
    for alias, mine in sorted(by_adapter.items()):
        budget = manifest.acceptance.budget(alias)
        failed = sum(not ok(record) for record in mine)
        if failed / len(mine) > budget.max_failure_rate:
            found.append(
                f"{alias}: {failed} of {len(mine)} requests failed "
                f"(budget {budget.max_failure_rate:.1%})"
            )
        ttfts = [record.ttft_ms for record in mine if ok(record) and record.ttft_ms is not None]
        if not ttfts:
            continue
        p95 = percentiles(ttfts).p95
        if p95 is not None and p95 > budget.ttft_p95_ms:
            found.append(
                f"{alias}: TTFT p95 {p95:.0f} ms > {budget.ttft_p95_ms:.0f} ms (n={len(ttfts)})"
            )
        elif p95 is None and max(ttfts) > budget.ttft_p95_ms:
            found.append(
                f"{alias}: TTFT max {max(ttfts):.0f} ms > {budget.ttft_p95_ms:.0f} ms "
                f"(n={len(ttfts)}, too few for a p95: every sample must pass)"
            )
    return found


def trial_result(
    manifest: Manifest, context: TrialContext, rate: float, plan: Plan, driven: Driven
) -> TrialResult:
    records = driven.records
    good = [record for record in records if ok(record)]
    return TrialResult(
        cell=context.cell,
        trial=context.trial,
        profile=context.profile,
        repetition=context.repetition,
        offered_rate=rate,
        duration_s=driven.duration_s,
        counts=counts(records),
        top1_share=plan.top1_share,
        top10_share=plan.top10_share,
        popular_before=plan.popular_before,
        popular_after=plan.popular_after,
        reversal_at_s=plan.reversal_at_s,
        throughput_rps=round(len(good) / driven.duration_s, 3) if driven.duration_s else 0.0,
        ttft_ms=_by(good, "adapter", "ttft_ms"),
        e2e_ms=_by(good, "adapter", "e2e_ms"),
        ttft_by_residency=_by(good, "residency_before", "ttft_ms"),
        load_ms={
            phase: percentiles(
                float(value) for record in good if (value := record.load_ms.get(phase)) is not None
            )
            for phase in ("fetch", "verify", "engine_load")
        },
        queue_depth=driven.queue_depth,
        worker_rss_mb=driven.worker_rss_mb,
        gpu_memory_mb=driven.gpu_memory_mb,
        prefetches=driven.prefetches,
        budget_violations=violations(manifest, records),
    )


def _misses(manifest: Manifest, records: list[RequestRecord], alias: str) -> list[RequestRecord]:
    budget = manifest.acceptance.budget(alias).ttft_p95_ms
    return [
        record
        for record in records
        if record.adapter == alias
        and (not ok(record) or (record.ttft_ms is not None and record.ttft_ms > budget))
    ]


def _explained(manifest: Manifest, record: RequestRecord) -> bool:
    """The miss coincides with an observed load or with queueing (not inferred from time)."""
    loaded = record.residency_before not in (None, "gpu", "unknown") and any(
        value for value in record.load_ms.values()
    )
    budget = manifest.acceptance.budget(record.adapter).ttft_p95_ms
    queued = record.queue_wait_ms is not None and record.queue_wait_ms >= QUEUEING_SHARE * budget
    return loaded or queued or record.code in LOAD_FAILURES


def _failed(trial: TrialResult) -> bool:
    """A trial that missed a budget, or whose load was not applied as planned."""
    return bool(trial.budget_violations) or trial.counts.delayed > 0 or trial.counts.dropped > 0


def _coverage_gaps(manifest: Manifest, cell: CellResult, records: list[RequestRecord]) -> list[str]:
    """What a cell lacks to support "candidate for a shared pool": both kinds of trial, and
    in each of them every approved adapter with enough answered requests for a p95."""
    gaps = []
    least = MIN_SAMPLES["p95"]
    for kind in TRIAL_KINDS:
        if not any(t.trial == kind for t in cell.trials):
            gaps.append(f"no {kind} trial")
            continue
        answered = Counter(
            r.adapter for r in records if r.cell == cell.id and r.trial == kind and ok(r)
        )
        short = [
            f"{entry.alias} n={answered[entry.alias]}"
            for entry in manifest.adapter_registry
            if answered[entry.alias] < least
        ]
        if short:
            gaps.append(f"{kind}: fewer than {least} answers for " + ", ".join(short[:6]))
    return gaps


def _config(cell: CellResult) -> str:
    c = cell.config
    limits = f"max_loras {c.max_loras}, max_cpu_loras {c.max_cpu_loras}, rank {c.max_lora_rank}"
    return f"{cell.id} ({limits})"


def decide(manifest: Manifest, cells: list[CellResult], records: list[RequestRecord]) -> Decision:
    """The share-versus-isolate table, hard gates first. Every row records its evidence; the
    verdict is the first row that holds, in the order the gates must be applied."""
    started = [cell for cell in cells if cell.trials]
    # Only the cells' own requests: a baseline (or anything else in the file) never decides.
    ours = {cell.id for cell in cells}
    records = [record for record in records if record.cell in ours]
    wrong = [record for record in records if mismatched(record)]
    base = manifest.base_model.digest
    foreign = [e.alias for e in manifest.adapter_registry if e.base != base]
    working_set = len(manifest.adapter_registry)
    popular = manifest.adapter_registry[0].alias

    rows: list[DecisionRow] = []
    verdict: str | None = None
    because: list[str] = []
    limits: dict[str, float] | None = None
    isolate: list[str] = []

    evidence = (
        f"{len(wrong)} completed request(s) whose worker-side metadata names another "
        "revision or unverified files"
        + (
            ": "
            + "; ".join(
                f"{r.cell}/{r.profile} #{r.seq} {r.adapter}: expected {r.expected_revision[:19]}, "
                f"ran {str(r.loaded_digest)[:19]}, verified {r.identity_verified}"
                for r in wrong[:5]
            )
            if wrong
            else ""
        )
    )
    rows.append(
        DecisionRow(
            condition="Adapter identity mismatch",
            evidence=evidence,
            decision=STOP,
            holds=bool(wrong),
        )
    )
    if wrong:
        verdict, because = STOP, [evidence]

    rows.append(
        DecisionRow(
            condition="Different trust or compatibility boundary",
            evidence=(
                f"adapters trained for another base digest: {foreign}"
                if foreign
                else f"every adapter names base {base[:19]}; the security review is not part of "
                "this experiment"
            ),
            decision=ISOLATE_BOUNDARY,
            holds=bool(foreign),
        )
    )
    if verdict is None and foreign:
        verdict, because, isolate = ISOLATE_BOUNDARY, [rows[-1].evidence], foreign

    if verdict is None and not started:
        verdict = NOTHING_RAN
        because = [
            f"{cell.id}: {cell.startup.outcome}: {(cell.startup.error or '')[:300]}"
            for cell in cells
        ]

    # Small stable working set: a cell where every trial (warmed and reset, every profile,
    # every rate) met every adapter's budget, with every approved adapter measured often
    # enough in each kind of trial, and the load applied on time.
    gaps = {cell.id: _coverage_gaps(manifest, cell, records) for cell in started}
    passing = [
        cell for cell in started if not gaps[cell.id] and not any(_failed(t) for t in cell.trials)
    ]
    passing.sort(key=lambda c: (c.config.max_loras, c.config.max_cpu_loras, c.config.max_lora_rank))
    evidence = (
        f"every trial passed in {', '.join(_config(c) for c in passing)}"
        if passing
        else "no cell passed every trial with enough evidence: "
        + "; ".join(
            f"{cell.id}: {sum(_failed(t) for t in cell.trials)} of {len(cell.trials)} trials "
            "missed a budget or were not applied on time"
            + (f", {'; '.join(gaps[cell.id][:3])}" if gaps[cell.id] else "")
            for cell in started
        )
    )
    rows.append(
        DecisionRow(
            condition="Small stable working set: all workloads pass warm and reset trials",
            evidence=evidence,
            decision=CANDIDATE,
            holds=bool(passing) if verdict in (None, CANDIDATE) else None,
        )
    )
    if verdict is None and passing:
        verdict = CANDIDATE
        because = [evidence, f"cheapest passing configuration: {_config(passing[0])}"]

    # Long tail beyond residency, per cell whose CPU capacity the working set exceeds: its
    # reset and reversal trials ran, and every trial passes up to some offered rate (each
    # rate at or below it passing) and misses above it: that rate is the limit measured.
    measured: dict[str, float] = {}
    beyond = [cell for cell in started if working_set > cell.config.max_cpu_loras]
    for cell in beyond:
        kinds = {t.trial for t in cell.trials}
        if "reset" not in kinds or not any(t.profile == "reversal" for t in cell.trials):
            continue
        rates = sorted({t.offered_rate for t in cell.trials})
        limit = None
        for rate in rates:
            if any(_failed(t) for t in cell.trials if t.offered_rate == rate):
                break
            limit = rate
        if limit is not None and limit < rates[-1]:
            measured[cell.id] = limit
    evidence = (
        f"working set {working_set} adapters exceeds max_cpu_loras in "
        f"{[cell.id for cell in beyond] or 'no cell'}; "
        + (
            "with reset and reversal trials, every trial passed up to "
            + ", ".join(f"{k}: {v:g} req/s" for k, v in measured.items())
            + " and missed above"
            if measured
            else "no such cell passed its reset and reversal trials at one offered rate and "
            f"missed at a higher one (offered rates: {manifest.offered_rates}), so no limit "
            "was measured"
        )
    )
    holds = bool(measured)
    rows.append(
        DecisionRow(
            condition="Long tail exceeds residency capacity; reload and popularity-reversal "
            "trials pass per-adapter budgets",
            evidence=evidence,
            decision=LIMITED,
            holds=holds if verdict in (None, LIMITED) else None,
        )
    )
    if verdict is None and holds:
        verdict, because, limits = LIMITED, [evidence], measured

    # A rare adapter misses its first-token budget, and its misses coincide with observed
    # loading or queueing.
    rare_misses: dict[str, tuple[int, int]] = {}
    for alias in sorted({r.adapter for r in records} - {popular}):
        misses = _misses(manifest, records, alias)
        if misses:
            rare_misses[alias] = (len(misses), sum(_explained(manifest, r) for r in misses))
    correlated = sorted(a for a, (n, explained) in rare_misses.items() if explained * 2 >= n)
    evidence = (
        "; ".join(
            f"{a}: {n} miss(es), {e} with an observed load or queueing"
            for a, (n, e) in rare_misses.items()
        )
        or "no adapter other than the popular one missed its budget"
    )
    rows.append(
        DecisionRow(
            condition="Rare adapter misses first-token budget; misses correlate with observed "
            "loading or queueing",
            evidence=evidence,
            decision=ISOLATE_RARE,
            holds=bool(correlated) if verdict in (None, ISOLATE_RARE) else None,
        )
    )
    if verdict is None and correlated:
        verdict, because, isolate = ISOLATE_RARE, [evidence], correlated

    if (
        verdict is None
        and all(gaps.values())
        and not any(_failed(t) for cell in started for t in cell.trials)
    ):
        verdict = INSUFFICIENT
        because = [
            "no budget was missed, but no cell has the evidence a shared pool needs: "
            + "; ".join(f"{cell}: {', '.join(found[:4])}" for cell, found in gaps.items())
        ]
    if verdict is None:
        verdict = NOT_SHARED
        because = [
            "no row of the table holds: budgets were missed and the misses are not explained "
            "by observed loading or queueing of rare adapters",
            *[v for cell in started for t in cell.trials for v in t.budget_violations][:10],
        ]
    return Decision(
        verdict=verdict, because=because, table=rows, admission_limits=limits, isolate=isolate
    )
