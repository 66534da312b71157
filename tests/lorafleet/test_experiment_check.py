"""`lorafleet experiment check` on its own local stack: the six acceptance checks pass, each
with its evidence, and nothing is left running."""

from __future__ import annotations

import re
from pathlib import Path

from tests.helpers import processes_with_env
from tests.lorafleet.test_cli import _cli, _isolated_env


def test_the_acceptance_checklist_passes_on_the_local_stack(tmp_path: Path) -> None:
    state = tmp_path / "state"
    env = {**_isolated_env(state), "COLUMNS": "200"}
    done = _cli(["experiment", "check"], env, timeout_s=1800)
    output = done.stdout
    assert done.returncode == 0, output + done.stderr
    assert "every check that ran passed" in output
    verdicts = dict(re.findall(r"^│ (\d) │.*?│ (pass|FAIL|skipped)\s+│", output, re.MULTILINE))
    assert verdicts == {str(n): "pass" for n in range(1, 7)}, output
    # the evidence each pass rests on, observed rather than assumed
    for evidence in (
        "404 adapter_not_found",
        "job records in the store: 0 before, 0 after",
        "rank_too_large",
        "base_model_mismatch",
        "greater than max_lora_ran",  # the engine's own words (the line may wrap after them)
        "equal the",  # tokens equal the transformers + PEFT reference
        "chunks streamed after the channel moved",
        "adapter_unavailable",
        "admitted unfinished back to zero: True",
    ):
        assert evidence in output, evidence
    assert "FAILED" not in output
    assert processes_with_env(str(state)) == []
