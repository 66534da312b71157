"""The soak's verdict: every accepted request ended once and right, nothing was lost, every
refusal carried a stable code, no callback had an effect twice, and memory came back.

A *violation* breaks a promise the README makes; the soak's test asserts there are none. The
rest are counts for the report (how many were refused, by code; how many jobs ran twice).
"""

from __future__ import annotations

import statistics
from collections import Counter
from dataclasses import dataclass, field
from typing import Any

from contracts.errors import ErrorCode
from contracts.webhooks import batch_event_id, job_event_id
from lorafleet.soak.faults import FaultRecord
from lorafleet.soak.receiver import Delivery
from lorafleet.soak.workload import BATCH_SIZE, TERMINAL, Outcome

STABLE_CODES = {code.value for code in ErrorCode}


@dataclass(frozen=True)
class Reference:
    """What greedy decoding of one (adapter, prompt) gives, from transformers + PEFT."""

    token_ids: tuple[int, ...]
    text: str


@dataclass
class Verdict:
    violations: list[str] = field(default_factory=list)
    counts: Counter[str] = field(default_factory=Counter)
    refusals: Counter[str] = field(default_factory=Counter)
    """error code (or "no answer") -> requests"""
    job_errors: Counter[str] = field(default_factory=Counter)
    """error code -> accepted jobs that ended failed"""
    attempts: Counter[int] = field(default_factory=Counter)
    """attempts a finished job took -> jobs"""

    def fail(self, what: str) -> None:
        self.violations.append(what)


CUT_AFTER_KILL_S = 10.0
"""A stream may break this long after a gateway kill (the kernel closes its connections at
once; the client notices on its next read)."""


def check_outcomes(
    outcomes: list[Outcome],
    references: dict[tuple[str, int], Reference],
    revisions: dict[str, str],
    gateway_kills: list[float],
    verdict: Verdict,
) -> None:
    """Each request as its caller saw it, against its job records and its reference."""
    for outcome in outcomes:
        verdict.counts["sent"] += 1
        if outcome.client_error:
            verdict.fail(f"{outcome.kind} sent at {outcome.sent_at:.1f} s: {outcome.client_error}")
            continue
        for status, code in outcome.refusals:
            verdict.refusals[code or f"HTTP {status} without a code"] += 1
            if code not in STABLE_CODES:
                verdict.fail(f"{outcome.kind} refused {status} without a stable code: {code!r}")
        if not outcome.accepted:
            if outcome.transport_errors and not outcome.refusals:
                verdict.refusals["no answer (gateway down)"] += 1
            continue
        verdict.counts["accepted"] += 1
        if outcome.kind == "batch":
            if outcome.batch is None:
                verdict.fail(
                    f"batch {outcome.batch_id} sent at {outcome.sent_at:.1f} s was accepted but "
                    f"never ended: {outcome.unresolved}"
                )
            else:
                _check_batch(outcome, references, revisions, verdict)
            continue
        if outcome.unresolved or len(outcome.jobs) < len(outcome.job_ids) or not outcome.job_ids:
            verdict.fail(
                f"{outcome.kind} sent at {outcome.sent_at:.1f} s was accepted "
                f"({outcome.job_ids}) but its end was never known: "
                f"{outcome.unresolved or 'no terminal record'}"
            )
            continue
        (job,) = outcome.jobs.values()
        _check_job(outcome.adapter, outcome.prompt, job, references, revisions, verdict)
        if outcome.late_error is not None:
            verdict.counts[f"completions answered {outcome.late_error} after acceptance"] += 1
        if job["status"] != "succeeded":
            continue
        want = references[(outcome.adapter, outcome.prompt)].text
        if outcome.kind == "completion" and outcome.late_error is None and outcome.text != want:
            verdict.fail(f"completion {job['id']}: {outcome.text!r} is not {want!r}")
        if outcome.kind == "stream":
            _check_stream(outcome, job, gateway_kills, verdict)


def _check_job(
    adapter: str,
    prompt: int,
    job: dict[str, Any],
    references: dict[tuple[str, int], Reference],
    revisions: dict[str, str],
    verdict: Verdict,
) -> None:
    verdict.counts[f"jobs {job['status']}"] += 1
    verdict.attempts[int(job.get("attempts") or 0)] += 1
    if job["status"] == "failed":
        code = (job.get("error") or {}).get("code")
        verdict.job_errors[str(code)] += 1
        if code not in STABLE_CODES:
            verdict.fail(f"job {job['id']} failed without a stable code: {job.get('error')}")
        return
    if job["status"] != "succeeded":  # nobody cancels in the soak; "expired", "queued": lost
        verdict.fail(f"job {job['id']} of {adapter} ended {job['status']}")
        return
    metadata = job.get("metadata") or {}
    result = job.get("result") or {}
    if metadata.get("revision") != revisions[adapter] or not metadata.get("identity_verified"):
        verdict.fail(
            f"job {job['id']} of {adapter}: ran {metadata.get('revision')}, verified "
            f"{metadata.get('identity_verified')}"
        )
    want = references[(adapter, prompt)]
    if tuple(result.get("token_ids") or ()) != want.token_ids:
        verdict.fail(
            f"job {job['id']} of {adapter}: tokens {result.get('token_ids')} are not its "
            f"reference {list(want.token_ids)} (wrong adapter, or base model)"
        )
    else:
        verdict.counts["outputs equal to their PEFT reference"] += 1


def _check_stream(
    outcome: Outcome, job: dict[str, Any], gateway_kills: list[float], verdict: Verdict
) -> None:
    if outcome.stream_cut_at is not None:
        cut = outcome.stream_cut_at
        if not any(0 <= cut - kill <= CUT_AFTER_KILL_S for kill in gateway_kills):
            verdict.fail(f"stream of {job['id']} broke at {cut:.1f} s, no gateway kill before")
        elif not job["result"]["text"].startswith(outcome.text or ""):
            verdict.fail(
                f"stream of {job['id']} delivered {outcome.text!r} before it broke, "
                f"not a prefix of {job['result']['text']!r}"
            )
        verdict.counts["streams cut by a gateway kill"] += 1
        return
    if outcome.stream_error is not None:
        verdict.fail(f"stream of {job['id']} (succeeded) ended with {outcome.stream_error}")
    elif not outcome.stream_done:
        verdict.fail(f"stream of {job['id']} (succeeded) ended without [DONE]")
    elif outcome.text != job["result"]["text"]:
        verdict.fail(f"stream of {job['id']}: {outcome.text!r} is not {job['result']['text']!r}")


def _check_batch(
    outcome: Outcome,
    references: dict[tuple[str, int], Reference],
    revisions: dict[str, str],
    verdict: Verdict,
) -> None:
    batch = outcome.batch or {}
    counts = batch.get("request_counts") or {}
    lines = outcome.batch_lines
    name = f"batch {outcome.batch_id}"
    total, completed, failed = (counts.get(k, -1) for k in ("total", "completed", "failed"))
    if total != BATCH_SIZE or completed + failed != BATCH_SIZE:
        verdict.fail(f"{name}: counts {counts} do not add up to {BATCH_SIZE}")
    if sorted(line["custom_id"] for line in lines) != sorted(outcome.batch_asked):
        verdict.fail(f"{name}: {len(lines)} result lines for {BATCH_SIZE} requests")
    if len({line["job_id"] for line in lines}) != len(lines):
        verdict.fail(f"{name}: a job appears twice in its results")
    succeeded = sum(line["status"] == "succeeded" for line in lines)
    if succeeded != completed:
        verdict.fail(f"{name}: {succeeded} lines succeeded, the counts say {counts}")
    for line in lines:
        adapter, prompt = outcome.batch_asked[line["custom_id"]]
        job = {"id": line["job_id"], **line}
        _check_job(adapter, prompt, job, references, revisions, verdict)
    verdict.counts["batches"] += 1


def check_webhooks(
    outcomes: list[Outcome], deliveries: dict[str, list[Delivery]], verdict: Verdict
) -> None:
    """Every finished job with a webhook, and every batch, was delivered exactly once: one
    2xx answer, no call for it after that, every call signed; and no call came for an event
    nobody asked for (a job admitted twice)."""
    expected: set[str] = set()
    for outcome in outcomes:
        if not outcome.accepted or (not outcome.jobs and outcome.batch is None):
            continue
        if outcome.kind == "job_webhook":
            (job,) = outcome.jobs.values()
            event_id, status = job_event_id(job["id"]), job["status"]
        elif outcome.kind == "batch" and outcome.batch_id:
            event_id, status = batch_event_id(outcome.batch_id), None
        else:
            continue
        calls = deliveries.get(event_id, [])
        expected.add(event_id)
        verdict.counts["webhook events"] += 1
        verdict.counts["webhook calls"] += len(calls)
        for call in calls:
            if not call.verified:
                verdict.fail(f"{event_id}: a call whose signature did not verify")
        ok = [i for i, call in enumerate(calls) if 200 <= call.answered < 300]
        if not ok:
            verdict.fail(f"{event_id}: never delivered ({len(calls)} calls)")
            continue
        if len(calls) > ok[0] + 1:
            verdict.fail(f"{event_id}: {len(calls) - ok[0] - 1} calls after it was answered 2xx")
        payload = calls[ok[0]].payload or {}
        if status is not None and (payload.get("data") or {}).get("status") != status:
            verdict.fail(f"{event_id}: delivered {payload.get('type')} for a job {status}")
    for event_id in sorted(set(deliveries) - expected):
        verdict.fail(f"{event_id}: {len(deliveries[event_id])} calls for an event no request had")


def check_records(outcomes: list[Outcome], seen: dict[str, str], verdict: Verdict) -> None:
    """Every job record that appeared in Redis ended, and belongs to a request: the jobs
    nobody can name are at most the completions whose answer never came (admitted, then the
    gateway killed); any more is a request admitted twice."""
    verdict.counts["job records seen in Redis"] = len(seen)
    for job_id, status in sorted(seen.items()):
        if status not in TERMINAL:
            verdict.fail(f"job {job_id} was last seen {status}: it never ended")
    named = {job_id for outcome in outcomes for job_id in outcome.job_ids}
    unnamed = sorted(set(seen) - named)
    may_be = sum(outcome.job_unknown for outcome in outcomes)
    verdict.counts["job records no caller could name"] = len(unnamed)
    if len(unnamed) > may_be:
        verdict.fail(
            f"{len(unnamed)} jobs ran that no request named, and only {may_be} requests went "
            f"unanswered: admitted twice? {unnamed[:10]}"
        )


def recovery(faults: list[FaultRecord], outcomes: list[Outcome]) -> list[dict[str, Any]]:
    """Per fault: when its part was back, and when a request sent after it first succeeded
    (what callers saw), plus how many of the next minute's requests did not succeed."""
    rows = []
    for fault in faults:
        after = [o for o in outcomes if o.sent_at >= fault.at_s]
        served = [
            o.done_at
            for o in after
            if o.done_at is not None
            and o.jobs
            and all(j["status"] == "succeeded" for j in o.jobs.values())
        ]
        # The rate-limited tenant's refusals are by design, not the fault's doing.
        window = [
            o
            for o in after
            if o.sent_at < fault.at_s + 60 and o.kind != "batch" and not _by_design(o)
        ]
        failed = [
            o
            for o in window
            if not o.jobs or any(j["status"] != "succeeded" for j in o.jobs.values())
        ]
        rows.append(
            {
                "fault": fault.name,
                "target": fault.target,
                "at_s": round(fault.at_s, 1),
                "restored_s": (
                    None
                    if fault.restored_at_s is None
                    else round(fault.restored_at_s - fault.at_s, 1)
                ),
                "served_s": round(min(served) - fault.at_s, 2) if served else None,
                "next_minute_not_ok": f"{len(failed)}/{len(window)}",
                "note": fault.note,
            }
        )
    return rows


def _by_design(outcome: Outcome) -> bool:
    """Refused for its tenant's rate limit (one tenant is limited on purpose)."""
    return not outcome.accepted and any(
        code == ErrorCode.TENANT_RATE_EXCEEDED for _, code in outcome.refusals
    )


def per_minute(outcomes: list[Outcome]) -> list[dict[str, Any]]:
    """By the minute requests were sent: how many, accepted, refused, succeeded; latency
    p50/p95 of those that succeeded (send to result) and streams' time to first text."""
    rows = []
    last = int(max((o.sent_at for o in outcomes), default=0) // 60)
    for minute in range(last + 1):
        sent = [o for o in outcomes if int(o.sent_at // 60) == minute and o.kind != "batch"]
        ok = [
            o
            for o in sent
            if o.jobs
            and all(j["status"] == "succeeded" for j in o.jobs.values())
            and o.latency_s is not None
        ]
        latencies = sorted(o.latency_s for o in ok if o.latency_s is not None)
        ttfts = sorted(o.ttft_s for o in sent if o.ttft_s is not None)
        rows.append(
            {
                "minute": minute,
                "sent": len(sent),
                "accepted": sum(o.accepted for o in sent),
                "refused": sum(bool(o.refusals) and not o.accepted for o in sent),
                "no_answer": sum(not o.accepted and not o.refusals for o in sent),
                "succeeded": len(ok),
                "p50_ms": _pct(latencies, 0.50),
                "p95_ms": _pct(latencies, 0.95),
                "ttft_p50_ms": _pct(ttfts, 0.50),
            }
        )
    return rows


def _pct(values: list[float], q: float) -> float | None:
    if not values:
        return None
    if len(values) == 1:
        return round(values[0] * 1000, 1)
    cuts = statistics.quantiles(values, n=100, method="inclusive")
    return round(cuts[int(q * 100) - 1] * 1000, 1)
