from __future__ import annotations

from datetime import UTC, datetime

from contracts.errors import ErrorBody, ErrorCode
from contracts.jobs import (
    EngineInfo,
    JobPublic,
    JobStatus,
    LoadTimings,
    ResultMetadata,
)
from contracts.queues import Tier
from contracts.registry import BaseModelRef
from lorafleet.report import percentile, summarise


def _job(alias: str, e2e_ms: float, residency: str, fetch: float | None) -> JobPublic:
    return JobPublic(
        id=f"{alias}-{e2e_ms}",
        status=JobStatus.SUCCEEDED,
        adapter=alias,
        revision="sha256:x",
        tenant="t",
        tier=Tier.HOT,
        queue="q",
        created_at=datetime.now(tz=UTC),
        metadata=ResultMetadata(
            adapter=alias,
            revision="sha256:x",
            loaded_digest="sha256:x",
            identity_verified=True,
            base_model=BaseModelRef(id="b", digest="sha256:b"),
            residency_before=residency,  # type: ignore[arg-type]
            load_ms=LoadTimings(fetch=fetch),
            queue_wait_ms=1,
            ttft_ms=1,
            e2e_ms=e2e_ms,
            worker="w",
            engine=EngineInfo(name="vllm", version="0"),
        ),
    )


def test_percentile_is_nearest_rank() -> None:
    values = [float(v) for v in range(1, 101)]
    assert percentile(values, 50) == 50
    assert percentile(values, 95) == 95
    assert percentile([7.0], 95) == 7
    assert percentile([], 50) is None


def test_summary_counts_per_tier_and_integrity_failures() -> None:
    jobs = [_job("a", 10, "remote", 5.0), _job("a", 20, "cpu", None), _job("b", 30, "disk", None)]
    failed = JobPublic(
        id="f",
        status=JobStatus.FAILED,
        adapter="b",
        revision="sha256:y",
        tenant="t",
        tier=Tier.HOT,
        queue="q",
        created_at=datetime.now(tz=UTC),
        error=ErrorBody(code=ErrorCode.ADAPTER_INTEGRITY, message="tampered"),
    )
    summary = summarise([*jobs, failed], {"a": "hot", "b": "cold"})
    assert summary["hot"]["jobs"] == 2
    assert summary["hot"]["residency_before"]["remote"] == 1
    assert summary["hot"]["residency_before"]["cpu"] == 1
    assert summary["hot"]["load_ms"]["fetch"] == {"count": 1, "p50_ms": 5.0, "max_ms": 5.0}
    assert summary["cold"]["failed"] == 1
    assert summary["cold"]["identity_mismatched"] == 1
    assert summary["all"]["identity_verified"] == 3
    assert summary["all"]["e2e_p50_ms"] == 20
