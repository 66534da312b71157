"""The share-versus-isolate decision on recorded requests: pure logic, no stack."""

from __future__ import annotations

from typing import Any

import pytest
import yaml

from lorafleet.experiment import analysis
from lorafleet.experiment.drive import Driven, TrialContext
from lorafleet.experiment.manifest import Manifest, local_template, parse
from lorafleet.experiment.results import CellConfig, CellResult, RequestRecord, Startup
from lorafleet.experiment.traffic import plan
from lorafleet.fixtures import write_fixtures


@pytest.fixture(scope="module")
def manifest(tmp_path_factory: pytest.TempPathFactory) -> Manifest:
    out = tmp_path_factory.mktemp("fixtures")
    specs = write_fixtures(out, 6)
    data = yaml.safe_load(
        local_template(out / "base", [(out / "adapters" / s.name, "cold") for s in specs], 200)
    )
    data["acceptance"] = {"default": {"ttft_p95_ms": 500.0, "max_failure_rate": 0.0}}
    return parse(yaml.safe_dump(data))


def _records(
    manifest: Manifest, profile: str, trial: str = "warmed", rate: float = 4.0, **override: Any
) -> tuple[list[RequestRecord], Any]:
    """Every planned request answered in 100 ms from the GPU with the expected revision,
    except where ``override(record) -> dict`` says otherwise."""
    generated = plan(manifest, profile, rate, 0)  # type: ignore[arg-type]
    digests = {e.alias: e.digest for e in manifest.adapter_registry}
    change = override.get("change", lambda record: {})
    records = []
    for p in generated.requests:
        fields: dict[str, Any] = {
            "cell": "c", "trial": trial, "profile": profile, "repetition": 0, "seq": p.seq,
            "offered_rate": rate,
            "arrival_s": p.arrival_s, "adapter": p.adapter, "prompt_id": p.prompt_id,
            "input_bucket": p.input_bucket, "max_tokens": p.max_tokens, "sent_s": p.arrival_s,
            "outcome": "completed", "ttft_ms": 100.0, "e2e_ms": 300.0, "job_id": f"j{p.seq}",
            "expected_revision": digests[p.adapter], "revision": digests[p.adapter],
            "loaded_digest": digests[p.adapter], "identity_verified": True,
            "residency_before": "gpu", "load_ms": {}, "queue_wait_ms": 5.0,
        }  # fmt: skip
        fields.update(change(fields))
        records.append(RequestRecord.model_validate(fields))
    return records, generated


def _cell(
    manifest: Manifest,
    change: Any = None,
    max_cpu_loras: int = 8,
    trials: tuple[str, ...] = ("warmed", "reset"),
    rates: tuple[float, ...] = (4.0,),
    cell_id: str = "c",
) -> tuple[CellResult, list[RequestRecord]]:
    cell = CellResult(
        id=cell_id,
        sweep="slots",
        config=CellConfig(max_loras=2, max_cpu_loras=max_cpu_loras, max_lora_rank=8),
        startup=Startup(outcome="started", seconds=30.0),
    )
    everything = []
    for trial in trials:
        for rate in rates:
            for profile in ("single", "uniform", "skewed", "reversal"):
                records, generated = _records(
                    manifest, profile, trial, rate, change=change or (lambda record: {})
                )
                records = [r.model_copy(update={"cell": cell_id}) for r in records]
                context = TrialContext(cell_id, trial, profile, 0, rate)  # type: ignore[arg-type]
                driven = Driven(records, 20.0, [], [])
                result = analysis.trial_result(manifest, context, rate, generated, driven)
                cell.trials.append(result)
                everything += records
    return cell, everything


def test_all_budgets_met_makes_a_candidate_for_a_shared_pool(manifest: Manifest) -> None:
    cell, records = _cell(manifest)
    decision = analysis.decide(manifest, [cell], records)
    assert decision.verdict == analysis.CANDIDATE
    assert decision.because[-1] == (
        "cheapest passing configuration: c (max_loras 2, max_cpu_loras 8, rank 8)"
    )
    trial = cell.trials[0]
    assert trial.counts.planned == trial.counts.completed == 200
    assert trial.counts.identity_mismatches == 0


def test_one_wrong_revision_stops_the_rollout_whatever_the_latency(manifest: Manifest) -> None:
    wrong = manifest.adapter_registry[1].digest

    def change(record: dict[str, Any]) -> dict[str, Any]:
        return (
            {"loaded_digest": wrong}
            if record["seq"] == 7 and record["profile"] == "uniform"
            else {}
        )

    cell, records = _cell(manifest, change)
    decision = analysis.decide(manifest, [cell], records)
    assert decision.verdict == analysis.STOP
    assert decision.table[0].holds is True
    assert "#7" in decision.because[0]
    # the later rows were not evaluated: no latency excuses a wrong identity
    assert all(row.holds is None for row in decision.table[2:])


def test_an_answer_without_worker_evidence_counts_as_a_mismatch(manifest: Manifest) -> None:
    def change(record: dict[str, Any]) -> dict[str, Any]:
        return {"identity_verified": None, "loaded_digest": None} if record["seq"] == 3 else {}

    cell, records = _cell(manifest, change)
    assert analysis.decide(manifest, [cell], records).verdict == analysis.STOP


def test_rare_adapters_missing_their_budget_while_loading_are_named(manifest: Manifest) -> None:
    popular = manifest.adapter_registry[0].alias

    def change(record: dict[str, Any]) -> dict[str, Any]:
        if record["adapter"] == popular or record["trial"] != "reset":
            return {}
        return {"ttft_ms": 2000.0, "residency_before": "remote", "load_ms": {"fetch": 900.0}}

    cell, records = _cell(manifest, change)
    decision = analysis.decide(manifest, [cell], records)
    assert decision.verdict == analysis.ISOLATE_RARE
    assert popular not in decision.isolate
    assert set(decision.isolate) == {e.alias for e in manifest.adapter_registry[1:]}


def test_misses_not_explained_by_loading_or_queueing_are_not_called_churn(
    manifest: Manifest,
) -> None:
    def change(record: dict[str, Any]) -> dict[str, Any]:
        return {"ttft_ms": 2000.0} if record["profile"] == "uniform" else {}

    cell, records = _cell(manifest, change)
    decision = analysis.decide(manifest, [cell], records)
    assert decision.verdict == analysis.NOT_SHARED
    assert decision.isolate == []


def test_failures_and_drops_count_against_the_failure_budget(manifest: Manifest) -> None:
    def change(record: dict[str, Any]) -> dict[str, Any]:
        if record["seq"] == 5 and record["profile"] == "single":
            return {"outcome": "dropped", "sent_s": None, "ttft_ms": None, "job_id": None}
        return {}

    cell, records = _cell(manifest, change)
    single = next(t for t in cell.trials if t.profile == "single")
    assert single.counts.dropped == 1 and single.counts.sent == 199
    assert any("1 of 200 requests failed" in v for v in single.budget_violations)
    assert analysis.decide(manifest, [cell], records).verdict != analysis.CANDIDATE


def test_a_rejected_configuration_is_no_latency(manifest: Manifest) -> None:
    rejected = CellResult(
        id="bad",
        sweep="slots",
        config=CellConfig(max_loras=4, max_cpu_loras=2, max_lora_rank=8),
        startup=Startup(outcome="rejected", error="max_cpu_loras must be at least max_loras"),
    )
    decision = analysis.decide(manifest, [rejected], [])
    assert decision.verdict == analysis.NOTHING_RAN
    assert "max_cpu_loras must be at least max_loras" in decision.because[0]


def test_percentiles_from_too_few_samples_are_not_numbers() -> None:
    few = analysis.percentiles([10.0] * 19)
    assert few.p50 == 10.0 and few.p95 is None and few.p99 is None
    many = analysis.percentiles([float(v) for v in range(1, 101)])
    assert (many.p50, many.p95, many.p99) == (50.0, 95.0, 99.0)


def test_without_reset_trials_or_enough_samples_there_is_no_candidate(manifest: Manifest) -> None:
    warmed_only, records = _cell(manifest, trials=("warmed",))
    decision = analysis.decide(manifest, [warmed_only], records)
    assert decision.verdict == analysis.INSUFFICIENT
    assert "no reset trial" in decision.because[0]
    few = manifest.model_copy(update={"requests_per_cell": 30})
    cell, records = _cell(few)
    decision = analysis.decide(few, [cell], records)
    assert decision.verdict == analysis.INSUFFICIENT
    assert "fewer than 20 answers" in decision.because[0]


def test_a_late_generator_invalidates_a_trial(manifest: Manifest) -> None:
    def change(record: dict[str, Any]) -> dict[str, Any]:
        late = record["seq"] == 9 and record["profile"] == "uniform"
        return {"sent_s": record["arrival_s"] + 0.5} if late else {}

    cell, records = _cell(manifest, change)
    assert next(t for t in cell.trials if t.profile == "uniform").counts.delayed == 1
    assert analysis.decide(manifest, [cell], records).verdict != analysis.CANDIDATE


def test_the_baselines_requests_never_decide(manifest: Manifest) -> None:
    cell, records = _cell(manifest)
    wrong = records[0].model_copy(
        update={"cell": "cold-swap", "identity_verified": False, "ttft_ms": 99_999.0}
    )
    assert analysis.decide(manifest, [cell], [*records, wrong]).verdict == analysis.CANDIDATE


def test_the_admission_limit_is_the_highest_rate_with_every_lower_rate_passing(
    manifest: Manifest,
) -> None:
    def change(record: dict[str, Any]) -> dict[str, Any]:
        # misses at 2 and 8 req/s, passes at 4: no contiguous passing range from the bottom
        return {"ttft_ms": 5000.0} if record["offered_rate"] in (2.0, 8.0) else {}

    holey, records = _cell(manifest, change, max_cpu_loras=4, rates=(2.0, 4.0, 8.0))
    assert analysis.decide(manifest, [holey], records).admission_limits is None

    def above_four(record: dict[str, Any]) -> dict[str, Any]:
        return {"ttft_ms": 5000.0} if record["offered_rate"] == 8.0 else {}

    small, small_records = _cell(
        manifest, above_four, max_cpu_loras=4, rates=(2.0, 4.0, 8.0), cell_id="small"
    )
    # a cell the working set fits in does not lend its limit to one it does not
    fits, fits_records = _cell(manifest, above_four, max_cpu_loras=8, rates=(2.0, 4.0, 8.0))
    decision = analysis.decide(manifest, [small, fits], small_records + fits_records)
    assert decision.verdict == analysis.LIMITED
    assert decision.admission_limits == {"small": 4.0}
