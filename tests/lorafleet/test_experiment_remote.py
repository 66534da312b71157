"""`lorafleet experiment run` and `check` against a deployment (`--gateway`): the session's
stack stands in for one; nothing of it is restarted."""

from __future__ import annotations

from pathlib import Path

import pytest
import yaml

from contracts.queues import Tier
from contracts.registry import AdapterRecord
from contracts.tenants import ALL_ADAPTERS
from lorafleet.experiment.analysis import INSUFFICIENT
from lorafleet.experiment.check import _tenant
from lorafleet.experiment.manifest import local_template
from lorafleet.experiment.results import RequestRecord, Results
from lorafleet.stack import LocalStack
from lorafleet.tenants import Tenants
from tests.lorafleet.test_cli import _cli, _isolated_env


@pytest.fixture(scope="module")
def operator_key(stack: LocalStack) -> str:
    tenants = Tenants(stack.redis())
    key = _tenant(tenants, "experiment-remote", operator=True)
    tenants.grant("experiment-remote", ALL_ADAPTERS)
    return key


def _cold(published: dict[str, AdapterRecord]) -> list[str]:
    return [alias for alias, record in published.items() if record.tier == Tier.COLD]


def test_a_deployment_runs_warmed_trials_and_is_not_called_a_candidate(
    stack: LocalStack,
    published: dict[str, AdapterRecord],
    fixtures_dir: Path,
    operator_key: str,
    tmp_path: Path,
) -> None:
    cold = _cold(published)[:3]
    adapters = [(fixtures_dir / "adapters" / alias, "cold") for alias in cold]
    data = yaml.safe_load(local_template(fixtures_dir / "base", adapters, 8, 8.0))
    data |= {"traffic_profiles": ["skewed"], "cold_swap_baseline": []}
    manifest = tmp_path / "manifest.yaml"
    manifest.write_text(yaml.safe_dump(data))
    out = tmp_path / "out"
    env = _isolated_env(tmp_path / "state")
    args = ["experiment", "run", str(manifest), "--out", str(out)]
    run = _cli([*args, "--gateway", stack.gateway_url, "--key", operator_key], env)
    assert run.returncode == 3, run.stdout + run.stderr  # no decision: no reset trial
    results = Results.model_validate_json((out / "results.json").read_text())
    assert results.mode == "remote"
    (cell,) = results.cells
    assert cell.startup.outcome == "assumed"
    assert [t.trial for t in cell.trials] == ["warmed"]
    assert cell.trials[0].counts.completed == 8
    assert cell.trials[0].counts.identity_mismatches == 0
    assert cell.trials[0].queue_depth  # an operator's key reads /v1/fleet
    assert results.decision.verdict == INSUFFICIENT
    assert "no reset trial" in results.decision.because[0]
    assert "workers (not restarted: a remote deployment)" in results.not_reset
    assert (out / "engine-help.txt").read_text().startswith("Not recorded")
    records = [
        RequestRecord.model_validate_json(line)
        for line in (out / "requests.jsonl").read_text().splitlines()
    ]
    assert all(r.loaded_digest == published[r.adapter].digest for r in records)
    # a deployment that resolves an alias to another revision is refused before anything runs
    data["adapter_registry"][0]["digest"] = published[cold[1]].digest
    manifest.write_text(yaml.safe_dump(data))
    again = tmp_path / "again"
    remote = ["--gateway", stack.gateway_url, "--key", operator_key]
    refused = _cli(["experiment", "run", str(manifest), "--out", str(again), *remote], env)
    assert refused.returncode == 2
    assert refused.stderr.startswith("manifest_mismatch: ")
    assert not again.exists()


def test_the_checks_a_deployment_allows_pass_and_the_rest_say_why_not(
    stack: LocalStack, published: dict[str, AdapterRecord], operator_key: str, tmp_path: Path
) -> None:
    adapters = [arg for alias in _cold(published) for arg in ("--adapter", alias)]
    env = _isolated_env(tmp_path / "state")
    args = ["experiment", "check", "--gateway", stack.gateway_url, "--key", operator_key]
    done = _cli([*args, *adapters], env, timeout_s=900)
    assert done.returncode == 0, done.stdout + done.stderr
    out = done.stdout
    for number, verdict in ((1, "pass"), (2, "skipped"), (3, "pass"), (4, "skipped")):
        assert f"│ {number} │" in out
        row = out.split(f"│ {number} │", 1)[1].split("\n", 1)[0]
        assert verdict in row, (number, row)
    assert "not run: an alias the key is not granted" in out
    assert "loading observed, not inferred: residency before" in out
    assert "admitted unfinished back to zero: True" in out
