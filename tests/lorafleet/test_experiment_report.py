"""The experiment report: pure rendering of synthetic results, plus a headless-browser check
that the page draws its plots when a Chromium is installed."""

from __future__ import annotations

import json
import random
import re
import shutil
import subprocess
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from lorafleet.experiment.analysis import LIMITED, percentiles
from lorafleet.experiment.report import _per_trial, render, write_report
from lorafleet.experiment.results import (
    CellConfig,
    CellResult,
    Counts,
    Decision,
    DecisionRow,
    Percentiles,
    RequestRecord,
    Results,
    Sample,
    Startup,
    TrialResult,
)

PLOTS = ("ttft-by-adapter-profile", "ttft-by-residency", "reversal-timeline", "sweep-heatmap")
ADAPTERS = ("support-en", "legal-2", "legal-10", "code-py")
REJECTION = "ValueError: max_loras * max_lora_rank exceeds the <KV cache> budget & more"
VERDICT = LIMITED
BROWSERS = ("chromium", "chromium-browser", "google-chrome", "headless_shell")


def _requests(
    profile: str, trial: str, count: int, seed: int, rate: float = 2.0
) -> list[RequestRecord]:
    rng = random.Random(seed)
    out = []
    for seq in range(count):
        arrival = round(seq * 0.5, 3)
        if profile == "reversal" and arrival >= 20:
            adapter = rng.choices(ADAPTERS, weights=(1, 1, 1, 8))[0]
        else:
            adapter = rng.choices(ADAPTERS, weights=(8, 1, 1, 1))[0]
        outcome = rng.choices(("completed", "failed", "dropped"), weights=(18, 1, 1))[0]
        residency = rng.choice(("gpu", "gpu", "cpu", "disk", "remote", None))
        ttft = rng.lognormvariate(5 if residency == "gpu" else 6.5, 0.4)
        done = outcome == "completed"
        fields: dict[str, Any] = {
            "cell": "c1", "trial": trial, "profile": profile, "repetition": 0, "seq": seq,
            "offered_rate": rate,
            "arrival_s": arrival, "adapter": adapter, "prompt_id": seq % 3, "input_bucket": 16,
            "max_tokens": 32, "sent_s": None if outcome == "dropped" else arrival,
            "outcome": outcome, "ttft_ms": round(ttft, 1) if done else None,
            "e2e_ms": round(ttft * 3, 1) if done else None, "expected_revision": "sha256:r",
            "residency_before": residency if outcome != "dropped" else None,
        }  # fmt: skip
        out.append(RequestRecord.model_validate(fields))
    return out


def _by(records: list[RequestRecord], key: str, value: str) -> dict[str, Percentiles]:
    groups: dict[str, list[float]] = {}
    for r in records:
        if getattr(r, value) is not None:
            groups.setdefault(str(getattr(r, key)), []).append(getattr(r, value))
    return {name: percentiles(values) for name, values in groups.items()}


def _trial(records: list[RequestRecord], **extra: Any) -> TrialResult:
    first = records[0]
    by = {o: sum(r.outcome == o for r in records) for o in ("completed", "failed", "dropped")}
    counts = Counts(
        planned=len(records), sent=len(records) - by["dropped"], dropped=by["dropped"],
        delayed=0, accepted=len(records) - by["dropped"], completed=by["completed"],
        failed=by["failed"], refused=0, cancelled=0, timeouts=0, failed_loads=by["failed"],
        identity_mismatches=0,
    )  # fmt: skip
    return TrialResult(
        cell=first.cell,
        trial=first.trial,
        profile=first.profile,
        repetition=first.repetition,
        offered_rate=2.0,
        duration_s=records[-1].arrival_s,
        counts=counts,
        top1_share=0.7,
        top10_share=1.0,
        throughput_rps=1.8,
        ttft_ms=_by(records, "adapter", "ttft_ms"),
        e2e_ms=_by(records, "adapter", "e2e_ms"),
        ttft_by_residency=_by(records, "residency_before", "ttft_ms"),
        load_ms={},
        **extra,
    )


def _experiment() -> tuple[Results, list[RequestRecord]]:
    skewed = _requests("skewed", "warmed", 60, seed=1)
    reversal = _requests("reversal", "reset", 80, seed=2)
    started = CellResult(
        id="c1",
        sweep="slots",
        config=CellConfig(max_loras=2, max_cpu_loras=4, max_lora_rank=16),
        startup=Startup(outcome="started", seconds=41.5),
        trials=[
            _trial(skewed, budget_violations=["legal-10: p95 TTFT 912 ms > 500 ms"]),
            _trial(
                reversal,
                popular_before="support-en",
                popular_after="code-py",
                reversal_at_s=20.0,
                queue_depth=[Sample(t=t, value=(t % 9) // 2) for t in range(0, 40, 2)],
            ),
        ],
    )
    rejected = CellResult(
        id="c2",
        sweep="slots",
        config=CellConfig(max_loras=4, max_cpu_loras=4, max_lora_rank=16),
        startup=Startup(outcome="rejected", seconds=3.0, error=REJECTION),
    )
    decision = Decision(
        verdict=VERDICT,
        because=["working set 4 adapters exceeds max_cpu_loras in ['c1']"],
        table=[
            DecisionRow(condition="Identity mismatch", evidence="0", decision="Stop", holds=False),
            DecisionRow(condition="Long tail", evidence="c1: 2/s", decision=VERDICT, holds=True),
            DecisionRow(condition="Rare adapter", evidence="-", decision="Isolate", holds=None),
        ],
        admission_limits={"c1": 2.0},
        isolate=["legal-10"],
    )
    results = Results(
        experiment_id="churn-test",
        mode="local",
        started_at="2025-01-01T10:00:00Z",
        finished_at="2025-01-01T10:05:00Z",
        manifest={"experiment_id": "churn-test", "offered_rates": [2.0]},
        reset_procedure="worker restarted, disk cache emptied",
        not_reset=["the page cache"],
        cells=[started, rejected],
        decision=decision,
    )
    return results, skewed + reversal


@pytest.fixture
def report(tmp_path: Path) -> Path:
    results, requests = _experiment()
    (tmp_path / "results.json").write_text(json.dumps(results.model_dump(mode="json")))
    (tmp_path / "requests.jsonl").write_text("".join(r.model_dump_json() + "\n" for r in requests))
    return write_report(tmp_path)


def _figures(page: str) -> dict[str, str]:
    found = re.findall(r'<figure[^>]*data-plot="([^"]+)"[^>]*>(.*?)</figure>', page, re.S)
    return dict(found)


def test_report_is_one_self_contained_page(report: Path) -> None:
    assert report == report.parent / "report.html"
    assert not list(report.parent.glob("*.tmp"))
    page = report.read_text()
    figures = _figures(page)
    assert list(figures) == list(PLOTS)  # in the page's order
    for name in PLOTS:
        assert "<svg" in figures[name] and "<path" in figures[name], name
        assert "<figcaption>" in figures[name]
    assert VERDICT in page
    assert "rejected" in page
    assert "ValueError: max_loras * max_lora_rank exceeds the &lt;KV cache&gt; budget" in page
    assert "<KV cache>" not in page
    assert "too few (n=" in page  # percentiles below their sample minimum are not numbers
    assert "not evaluated" in page and "does not hold" in page
    for loading in ('src="http', "src='http", 'href="http', "href='http", "<script", "@import"):
        assert loading not in page, loading


def test_records_split_per_trial_when_only_the_rate_differs() -> None:
    results, _ = _experiment()
    cell = results.cells[0]
    again = cell.trials[1].model_copy(update={"offered_rate": 4.0, "reversal_at_s": 10.0})
    cell.trials.append(again)
    first = _requests("reversal", "reset", 80, seed=2)
    second = _requests("reversal", "reset", 40, seed=3, rate=4.0)
    split = _per_trial(results, _requests("skewed", "warmed", 60, seed=1) + first + second)
    assert split[id(cell.trials[1])] == first
    assert split[id(again)] == second
    timeline = _figures(render(results, first + second))["reversal-timeline"]
    assert "c1 · reset · reversal · 2 req/s · repetition 0" in timeline  # the first one


def test_report_renders_in_a_browser(report: Path, tmp_path: Path) -> None:
    browser = next((path for name in BROWSERS if (path := shutil.which(name))), None)
    if browser is None:
        pytest.skip(
            "no Chromium found: install one (Debian: apt install chromium) to check the "
            "report renders"
        )
    from PIL import Image

    shot = tmp_path / "report.png"
    base = [browser, "--headless", "--no-sandbox", "--disable-gpu", "--disable-dev-shm-usage",
            "--hide-scrollbars", f"--user-data-dir={tmp_path / 'profile'}"]  # fmt: skip
    url = report.resolve().as_uri()
    dom = subprocess.run(
        [*base, "--dump-dom", url], capture_output=True, text=True, timeout=120, check=True
    ).stdout
    figures = _figures(dom)
    assert set(figures) == set(PLOTS), dom[:2000]
    for name, inner in figures.items():
        svg = re.search(r"<svg.*?</svg>", inner, re.S)
        assert svg is not None and "<path" in svg.group(0), name
    subprocess.run(
        [*base, f"--screenshot={shot}", "--window-size=1280,4000", url],
        capture_output=True,
        timeout=120,
        check=True,
    )
    with Image.open(shot) as image:
        assert image.size == (1280, 4000)
        pixels = np.asarray(image.convert("RGB")).reshape(-1, 3)
    drawn = int((pixels != 255).any(axis=1).sum())
    assert drawn > len(pixels) // 50, drawn  # more than 2% of the page is not blank
    colours = len(np.unique(pixels, axis=0))
    assert colours > 200, colours  # text, plot colours and antialiasing: not a flat page
