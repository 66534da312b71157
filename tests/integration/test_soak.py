"""Three minutes of the soak (``benchmarks/soak.py`` runs thirty): two real workers under an
open-loop mix of every API while every fault of the schedule happens once or twice (a
worker's process group SIGKILLed twice, Redis SIGKILLed and restarted on its append-only file,
S3 off the network for 10 s, the gateway SIGKILLed, an engine core killed).

The promises checked (``lorafleet.soak.checks``): every accepted request ended exactly once
with its reference output and a verified revision, no job record was left unfinished, every
refusal carried a stable code, each webhook event was answered 2xx once and never called
after, batch counts add up, and once the retention passed nothing written during the run is
left without a TTL and Redis's key count and memory are back near their start.

It runs on a stack of its own (its own Redis with an append-only file, its own S3), after
every other test: it kills processes, and it wants the machine's two cores.
"""

from __future__ import annotations

from pathlib import Path

import pytest
from rich.console import Console

from lorafleet.soak.faults import schedule_for
from lorafleet.soak.report import print_report
from lorafleet.soak.run import SoakConfig, run_soak

DURATION_S = 180.0
RSS_GROWTH_MB_PER_H = 500.0
"""What a three-minute run can tell from noise: a leak of ~0.5 MB a request at 3 requests a
second would show; the 30-minute run in the README measures the slopes themselves."""


@pytest.mark.soak
def test_three_minutes_of_every_api_and_every_fault_lose_nothing_and_leave_nothing(
    tmp_path: Path,
) -> None:
    config = SoakConfig(
        state_dir=tmp_path,
        duration_s=DURATION_S,
        rate_per_s=3.0,
        retention_s=60,
        worker_kill_every_s=None,
    )
    result = run_soak(config, say=print)
    print_report(result, Console(width=160))  # in the test's output, for whoever reads a failure
    verdict = result.verdict
    assert verdict.violations == [], "\n".join(verdict.violations[:30])

    # Every scheduled fault happened, and what it took came back.
    assert sorted(f["fault"] for f in result.faults) == sorted(
        name for _, name in schedule_for(DURATION_S)
    )
    assert all(f["restored_s"] is not None and not f["note"] for f in result.faults), result.faults
    # Killed processes were restarted: two worker kills and the engine core's worker (which
    # exits by itself), the gateway.
    restarted = [name for _, name, _ in result.restarts]
    assert sum(name.startswith("soak-worker") for name in restarted) >= 3, restarted
    assert "gateway" in restarted

    # The run exercised what it claims to check.
    counts = verdict.counts
    assert counts["accepted"] >= 0.7 * counts["sent"], counts
    assert counts["outputs equal to their PEFT reference"] >= 200, counts
    assert counts["batches"] >= 1 and counts["webhook events"] >= 20, counts
    assert verdict.refusals["tenant_rate_exceeded"] >= 1, verdict.refusals
    assert counts["job records seen in Redis"] >= counts["accepted"], counts

    for row in result.rss:
        if row["process"] in ("gateway", "webhooks") and row["life_s"] >= 60:
            assert row["slope_mb_per_h"] is None or row["slope_mb_per_h"] < RSS_GROWTH_MB_PER_H, row
