"""The soak's checks fail when they should (pure logic: outcomes and deliveries made up here;
the soak itself runs in tests/integration/test_soak.py)."""

from __future__ import annotations

import asyncio
import time
from typing import Any

from contracts.webhooks import job_event_id
from lorafleet.soak.checks import (
    Reference,
    Verdict,
    check_outcomes,
    check_records,
    check_webhooks,
)
from lorafleet.soak.receiver import Delivery
from lorafleet.soak.workload import Mix, Outcome, Traffic

REVISION = "sha256:" + "a" * 64
REFS = {("tail", 0): Reference((5, 6, 7), "abc")}


def _job(
    job_id: str, status: str = "succeeded", tokens: tuple[int, ...] = (5, 6, 7)
) -> dict[str, Any]:
    return {
        "id": job_id,
        "status": status,
        "attempts": 1,
        "result": {"text": "abc", "token_ids": list(tokens)},
        "metadata": {"revision": REVISION, "identity_verified": True},
    }


def _outcome(kind: str, job: dict[str, Any] | None = None, **fields: Any) -> Outcome:
    outcome = Outcome(kind, "t", "tail", 0, sent_at=1.0, accepted=job is not None, **fields)
    if job is not None:
        outcome.job_ids = [job["id"]]
        outcome.jobs = {job["id"]: job}
    return outcome


def _verdict(outcomes: list[Outcome], kills: list[float] | None = None) -> Verdict:
    verdict = Verdict()
    check_outcomes(outcomes, REFS, {"tail": REVISION}, kills or [], verdict)
    return verdict


def test_a_right_job_passes_and_a_wrong_output_or_revision_is_a_violation() -> None:
    assert _verdict([_outcome("job", _job("j1"))]).violations == []
    (wrong,) = _verdict([_outcome("job", _job("j2", tokens=(5, 6, 8)))]).violations
    assert "not its reference" in wrong
    unverified = _job("j3")
    unverified["metadata"]["identity_verified"] = False
    assert "verified False" in _verdict([_outcome("job", unverified)]).violations[0]


def test_an_accepted_request_without_an_end_or_with_an_unstable_code_is_a_violation() -> None:
    lost = _outcome("job", _job("j1"))
    lost.jobs = {}
    assert "never known" in _verdict([lost]).violations[0]
    refused = _outcome("job", refusals=[(503, None)])
    assert "without a stable code" in _verdict([refused]).violations[0]
    assert _verdict([_outcome("job", refusals=[(429, "tenant_rate_exceeded")])]).violations == []
    cancelled = _outcome("job", _job("j2", status="cancelled"))
    assert "ended cancelled" in _verdict([cancelled]).violations[0]


def test_a_stream_may_break_only_right_after_a_gateway_kill_and_only_on_a_prefix() -> None:
    def cut(at: float, text: str) -> Outcome:
        return _outcome("stream", _job("s1"), stream_cut_at=at, text=text)

    assert _verdict([cut(12.0, "ab")], kills=[10.0]).violations == []
    assert "no gateway kill" in _verdict([cut(40.0, "ab")], kills=[10.0]).violations[0]
    assert "not a prefix" in _verdict([cut(12.0, "xy")], kills=[10.0]).violations[0]
    errored = _outcome("stream", _job("s2"), stream_error={"code": "x"}, text="abc")
    assert "ended with" in _verdict([errored]).violations[0]


def test_a_webhook_delivered_twice_never_or_unasked_for_is_a_violation() -> None:
    outcome = _outcome("job_webhook", _job("j1"))
    event = job_event_id("j1")
    payload = {"type": "job.succeeded", "data": {"status": "succeeded"}}

    def verdict(deliveries: dict[str, list[Delivery]]) -> list[str]:
        result = Verdict()
        check_webhooks([outcome], deliveries, result)
        return result.violations

    failed, ok = Delivery(0, 503, True, payload), Delivery(0, 200, True, payload)
    assert verdict({event: [failed, ok]}) == []
    assert "calls after it was answered 2xx" in verdict({event: [ok, ok]})[0]
    assert "never delivered" in verdict({event: [failed]})[0]
    assert "signature did not verify" in verdict({event: [Delivery(0, 200, False, None)]})[0]
    extra = verdict({event: [ok], job_event_id("j9"): [ok]})
    assert len(extra) == 1 and "no request had" in extra[0]


def test_jobs_nobody_named_are_allowed_only_for_requests_never_answered() -> None:
    named = _outcome("job", _job("j1"))
    unanswered = _outcome("completion", job_unknown=True)
    seen = {"j1": "succeeded", "orphan": "succeeded"}
    verdict = Verdict()
    check_records([named, unanswered], seen, verdict)
    assert verdict.violations == []
    verdict = Verdict()
    check_records([named], seen, verdict)
    assert "admitted twice" in verdict.violations[0]
    verdict = Verdict()
    check_records([named], {"j1": "running"}, verdict)
    assert "never ended" in verdict.violations[0]


def test_the_traffic_keeps_the_runs_clock_so_its_times_compare_with_the_faults() -> None:
    """CI once saw a stream cut by the gateway kill stamped 0.1 s before the kill: the
    traffic restarted its own clock after the run's had started."""
    traffic = Traffic("http://127.0.0.1:9", Mix((), {}), 1.0, "http://127.0.0.1:9/hook", 1.0)
    origin = time.monotonic() - 5.0  # the run began 5 s ago
    traffic.started = origin
    asyncio.run(traffic.run(0.0, 0.0))  # nothing to send: only the clock matters
    assert traffic.started == origin
    assert traffic.now() >= 5.0
