"""The experiment's report: one self-contained HTML page (inline SVG plots, no network),
rebuilt from ``results.json`` and ``requests.jsonl`` alone."""

from __future__ import annotations

import html
import io
import json
import re
from collections import defaultdict
from collections.abc import Iterable, Sequence
from pathlib import Path
from typing import Any, get_args

import matplotlib
import numpy as np
from matplotlib.axes import Axes
from matplotlib.backends.backend_agg import FigureCanvasAgg
from matplotlib.cm import ScalarMappable
from matplotlib.colors import Colormap, LogNorm, Normalize, to_hex, to_rgb
from matplotlib.figure import Figure
from matplotlib.lines import Line2D
from matplotlib.patches import Rectangle

from lorafleet.experiment.analysis import (
    CANDIDATE,
    INSUFFICIENT,
    NOT_SHARED,
    NOTHING_RAN,
    STOP,
    ok,
    percentiles,
)
from lorafleet.experiment.results import (
    MIN_SAMPLES,
    CellConfig,
    CellResult,
    Percentiles,
    ProfileName,
    RequestRecord,
    Residency,
    Results,
    Sample,
    TrialResult,
)

PROFILES: tuple[str, ...] = get_args(ProfileName)
LEVELS: tuple[str, ...] = get_args(Residency)
# Okabe-Ito colours: distinguishable with the common colour-vision deficiencies.
RESIDENCY_COLOURS = {
    "gpu": "#009E73",
    "cpu": "#0072B2",
    "disk": "#E69F00",
    "remote": "#D55E00",
    "unknown": "#999999",
}
STRIP_MAX = 800  # points drawn per residency level; more are subsampled
RASTER_FROM = 2000  # scatter points from which a layer is embedded as an image, not vectors
NO_SVG_METADATA = {"Format": None, "Type": None, "Creator": None, "Date": None}

TrialKey = tuple[str, str, str, int, float]


def load(out_dir: Path) -> tuple[Results, list[RequestRecord]]:
    """``DIR/results.json`` and the records of ``DIR/requests.jsonl`` (none if absent)."""
    results = Results.model_validate_json((out_dir / "results.json").read_text())
    path = out_dir / "requests.jsonl"
    lines = path.read_text().splitlines() if path.exists() else []
    return results, [RequestRecord.model_validate_json(line) for line in lines if line.strip()]


def write_report(out_dir: Path) -> Path:
    """Render ``DIR/report.html`` from the results in ``DIR``; written atomically."""
    results, requests = load(out_dir)
    path = out_dir / "report.html"
    tmp = path.with_suffix(".html.tmp")
    tmp.write_text(render(results, requests), encoding="utf-8")
    tmp.replace(path)
    return path


def render(results: Results, requests: list[RequestRecord]) -> str:
    """The report page as HTML text."""
    everything = requests
    if results.baseline is not None:  # the baseline has its own section, never pooled in
        requests = [r for r in requests if r.cell != results.baseline.id]
    body = [
        _header(results),
        _decision_table(results),
        _cells(results),
        _baseline(results, everything),
        _section(
            "TTFT per adapter and profile",
            _plot(
                "ttft-by-adapter-profile",
                _ttft_by_adapter(requests),
                "Time to first token of completed requests, per adapter (n above each box), "
                "one panel per traffic profile, pooled over cells, trials and repetitions. Boxes: "
                "quartiles and median; whiskers: 1.5 IQR; dots: requests beyond them.",
            ),
        ),
        _section(
            "TTFT by residency before arrival",
            _plot(
                "ttft-by-residency",
                _ttft_by_residency(requests),
                "Time to first token of completed requests by where the adapter was when the "
                "request arrived (not reported counts as unknown), pooled over all trials; "
                "boxes: quartiles and median, whiskers 1.5 IQR; dots: the requests (at most "
                f"{STRIP_MAX} per level, sampled).",
            ),
        ),
        _section("Popularity reversal", _reversal(results, requests)),
        _section(
            "Sweep: p95 TTFT per configuration",
            _plot(
                "sweep-heatmap",
                _sweep_heatmap(results, requests),
                "p95 time to first token over every completed request of a cell (all trials, "
                "profiles and rates). Hatched: the engine rejected the configuration; "
                f"'too few': fewer than {MIN_SAMPLES['p95']} samples.",
            ),
        ),
        _percentile_tables(results),
        _section(
            "Manifest",
            "<details><summary>manifest as run</summary><pre>"
            + _e(json.dumps(results.manifest, indent=1, default=str))
            + "</pre></details>",
        ),
    ]
    title = f"lorafleet experiment {results.experiment_id}"
    return (
        '<!DOCTYPE html>\n<html lang="en">\n<head>\n<meta charset="utf-8">\n'
        '<meta name="viewport" content="width=device-width, initial-scale=1">\n'
        f"<title>{_e(title)}</title>\n<style>{CSS}</style>\n</head>\n<body>\n<main>\n"
        f"<h1>{_e(title)}</h1>\n" + "\n".join(body) + "\n</main>\n</body>\n</html>\n"
    )


# --- HTML -------------------------------------------------------------------------------


def _e(value: object) -> str:
    return html.escape(str(value))


def _section(title: str, content: str) -> str:
    return f"<section>\n<h2>{_e(title)}</h2>\n{content}\n</section>"


def _table(head: list[str], rows: Sequence[list[str] | str], cls: str = "") -> str:
    """A table of already escaped cells (a ``str`` row spans the table); the head is
    escaped here."""
    th = "".join(f"<th>{_e(name)}</th>" for name in head)
    body = "\n".join(
        f'<tr class="note"><td colspan="{len(head)}">{row}</td></tr>'
        if isinstance(row, str)
        else "<tr>" + "".join(f"<td>{c}</td>" for c in row) + "</tr>"
        for row in rows
    )
    return (
        f'<div class="scroll"><table class="{cls}"><thead><tr>{th}</tr></thead>'
        f"<tbody>\n{body}\n</tbody></table></div>"
    )


def _list(items: Iterable[str]) -> str:
    return "<ul>" + "".join(f"<li>{_e(item)}</li>" for item in items) + "</ul>"


def _verdict_class(verdict: str) -> str:
    if verdict in (STOP, NOT_SHARED):
        return "stop"
    if verdict == CANDIDATE:
        return "go"
    return "none" if verdict in (NOTHING_RAN, INSUFFICIENT) else "caution"


def _header(results: Results) -> str:
    d = results.decision
    facts = [
        ("experiment", results.experiment_id),
        ("mode", results.mode),
        ("started", results.started_at),
        ("finished", results.finished_at),
    ]
    dl = "".join(f"<dt>{_e(k)}</dt><dd>{_e(v)}</dd>" for k, v in facts)
    parts = [
        f'<dl class="facts">{dl}</dl>',
        f'<p class="verdict {_verdict_class(d.verdict)}">{_e(d.verdict)}</p>',
        "<h3>Because</h3>" + (_list(d.because) if d.because else "<p>(no reason recorded)</p>"),
    ]
    if d.isolate:
        parts.append("<h3>Isolate</h3>" + _list(d.isolate))
    if d.admission_limits:
        limits = (f"{cell}: {rate:g} req/s" for cell, rate in d.admission_limits.items())
        parts.append("<h3>Admission limits measured</h3>" + _list(limits))
    parts.append(f"<h3>Reset before each reset trial</h3><p>{_e(results.reset_procedure)}</p>")
    if results.not_reset:
        parts.append("<h3>Not reset between trials</h3>" + _list(results.not_reset))
    return _section("Decision", "\n".join(parts))


def _decision_table(results: Results) -> str:
    # The row that decided is marked; whether holding is good depends on the row, so
    # neither state is coloured as a pass or a failure.
    states = {True: ("holds", "decided"), False: ("does not hold", "")}
    rows = []
    for row in results.decision.table:
        text, cls = states[row.holds] if row.holds is not None else ("not evaluated", "muted")
        if row.holds and row.decision != results.decision.verdict:
            cls = ""
        rows.append(
            [
                _e(row.condition),
                _e(row.evidence),
                _e(row.decision),
                f'<span class="{cls}">{_e(text)}</span>',
            ]
        )
    return _section(
        "Decision table",
        _table(["condition", "evidence", "decision", "holds"], rows, "decision"),
    )


def _config_text(config: CellConfig) -> str:
    return (
        f"max_loras {config.max_loras}, max_cpu_loras {config.max_cpu_loras}, "
        f"max_lora_rank {config.max_lora_rank}"
    )


def _share(value: float) -> str:
    return f"{value:.0%}"


def _startup(cell: CellResult) -> str:
    s = cell.startup
    text = _e(s.outcome) + (f" in {s.seconds:.1f} s" if s.seconds is not None else "")
    failed = s.outcome in ("rejected", "timeout")
    return f'<span class="fails">{text}</span>' if failed else text


def _flag(count: int) -> str:
    return f'<span class="fails">{count}</span>' if count else "0"


def _cells(results: Results) -> str:
    """An overview row per cell, then each cell's trials (collapsed in large sweeps)."""
    overview = []
    for cell in results.cells:
        c = cell.config
        counts = [t.counts for t in cell.trials]
        overview.append(
            [_e(cell.id), _e(cell.sweep)]
            + [str(n) for n in (c.max_loras, c.max_cpu_loras, c.max_lora_rank)]
            + [_startup(cell), str(len(cell.trials))]
            + [f"{sum(n.completed for n in counts)} / {sum(n.planned for n in counts)}"]
            + [str(sum(n.failed + n.refused + n.timeouts for n in counts))]
            + [_flag(sum(n.identity_mismatches for n in counts))]
            + [_flag(sum(bool(t.budget_violations) for t in cell.trials))]
        )
    head = [
        "cell", "sweep", "max_loras", "max_cpu_loras", "max_lora_rank", "startup", "trials",
        "completed / planned", "failed, refused or timed out", "identity mismatches",
        "trials missing a budget",
    ]  # fmt: skip
    parts = [_table(head, overview, "counts")] if overview else ["<p>no cells</p>"]
    for cell in results.cells:
        opened = len(results.cells) <= 3 or cell.startup.outcome != "started" or cell.stopped
        parts.append(
            f'<details class="cell"{" open" if opened else ""}><summary><b>{_e(cell.id)}</b> · '
            f"sweep {_e(cell.sweep)} · {_e(_config_text(cell.config))} · startup: "
            f"{_startup(cell)}</summary>"
        )
        if cell.startup.error:
            parts.append(f'<pre class="error">{_e(cell.startup.error)}</pre>')
        parts.append(_trials_table(cell.trials) if cell.trials else "<p>no trials ran</p>")
        if cell.stopped:
            parts.append(
                f'<p class="fails">trials stopped early:</p><pre class="error">'
                f"{_e(cell.stopped)}</pre>"
            )
        parts.append("</details>")
    return _section("Cells", "\n".join(parts))


def _trials_table(trials: list[TrialResult]) -> str:
    head = [
        "trial", "profile", "rate (req/s)", "rep", "planned", "sent", "dropped", "delayed",
        "completed", "failed", "refused", "timeouts", "failed loads", "identity mismatches",
        "top1", "top10", "throughput (req/s)", "worker RSS MB (first, max)",
        "GPU memory MB (max)", "budget violations",
    ]  # fmt: skip
    rows: list[list[str] | str] = []
    for t in trials:
        c = t.counts
        rows.append(
            [_e(v) for v in (t.trial, t.profile, f"{t.offered_rate:g}", t.repetition)]
            + [str(n) for n in (c.planned, c.sent, c.dropped, c.delayed, c.completed)]
            + [str(n) for n in (c.failed, c.refused, c.timeouts, c.failed_loads)]
            + [_flag(c.identity_mismatches)]
            + [_share(t.top1_share), _share(t.top10_share), f"{t.throughput_rps:.2f}"]
            + [_memory(t.worker_rss_mb), _memory(t.gpu_memory_mb, first=False)]
            + [_flag(len(t.budget_violations))]
        )
        if t.budget_violations:
            rows.append("budget violations:" + _list(t.budget_violations))
    return _table(head, rows, "counts trials")


def _memory(samples: list[Sample] | None, first: bool = True) -> str:
    if not samples:
        return "-"
    top = f"{max(s.value for s in samples):,.0f}"
    return f"{samples[0].value:,.0f}, {top}" if first else top


def _baseline(results: Results, requests: list[RequestRecord]) -> str:
    """lorafleet's started cells beside the cold-swap baseline, on the same generated
    sequences (same profile, rate and repetition; lorafleet's warmed trials)."""
    baseline = results.baseline
    if baseline is None:
        return ""
    if baseline.startup.outcome == "rejected" or not baseline.trials:
        error = f"<pre>{_e(baseline.startup.error or '')}</pre>"
        return _section("Cold-swap baseline", "<p>The baseline did not start.</p>" + error)
    records = _per_trial(results, requests)
    rows: list[list[str] | str] = []
    for base in baseline.trials:
        same = [
            t
            for cell in results.cells
            for t in cell.trials
            if (t.trial, t.profile, t.offered_rate, t.repetition)
            == ("warmed", base.profile, base.offered_rate, base.repetition)
        ]
        base_p95 = percentiles(_ttfts(records[id(base)])).p95
        for t in [*same, base]:
            ttft = percentiles(_ttfts(records[id(t)]))
            ratio = (
                f"{ttft.p95 / base_p95:.2f}x"
                if ttft.p95 is not None and base_p95 and t is not base
                else "-"
            )
            name = "cold-swap baseline" if t is base else t.cell
            rows.append(
                [
                    _e(name),
                    _e(t.profile),
                    f"{t.offered_rate:g}",
                    f"{t.counts.completed}/{t.counts.planned}",
                    f"{t.throughput_rps:.2f}",
                    _pct(ttft, "p50"),
                    _pct(ttft, "p95"),
                    ratio,
                ]
            )
    head = ["server", "profile", "offered req/s", "completed", "req/s", "TTFT p50 ms"]
    head += ["TTFT p95 ms", "p95 vs baseline"]
    text = (
        "<p>The same generated sequences against one transformers + PEFT model object that "
        "serves one request at a time and swaps the adapter in place (unload, load from "
        "disk, digest checked) whenever consecutive requests differ.</p>"
    )
    return _section("Cold-swap baseline", text + _table(head, rows))


def _ttfts(records: list[RequestRecord]) -> list[float]:
    return [r.ttft_ms for r in records if _answered(r) and r.ttft_ms is not None]


def _ms(value: float) -> str:
    return f"{value:,.0f}" if value >= 100 else f"{value:.3g}"


def _pct(p: Percentiles | None, name: str) -> str:
    if p is None:
        return "-"
    value = getattr(p, name)
    if value is None:
        return f'<span class="muted">too few (n={p.n})</span>'
    return _ms(value)


def _percentile_rows(
    names: list[tuple[str, str]],
    first: dict[str, Percentiles],
    second: dict[str, Percentiles] | None,
) -> list[list[str]]:
    """A row per ``(key, label)``: ``first[key]``, then ``second[key]`` if given."""
    rows = []
    for name, label in names:
        a = first.get(name)
        row = [_e(label), str(a.n if a else 0)] + [_pct(a, q) for q in ("p50", "p95", "p99")]
        if second is not None:
            b = second.get(name)
            row += [str(b.n if b else 0)] + [_pct(b, q) for q in ("p50", "p95", "p99")]
        rows.append(row)
    return rows


def _percentile_tables(results: Results) -> str:
    quantiles = ["p50", "p95", "p99"]
    adapter_head = ["adapter", "TTFT n", *(f"TTFT {q}" for q in quantiles)]
    adapter_head += ["e2e n", *(f"e2e {q}" for q in quantiles)]
    residency_head = ["residency before", "TTFT n", *(f"TTFT {q}" for q in quantiles)]
    blocks = []
    for cell in results.cells:
        if not cell.trials:
            continue
        blocks.append(f"<h3>{_e(cell.id)} <small>{_e(_config_text(cell.config))}</small></h3>")
        for t in cell.trials:
            adapters = _natural_sorted(set(t.ttft_ms) | set(t.e2e_ms))
            levels = [lv for lv in LEVELS if lv in t.ttft_by_residency]
            levels += sorted(set(t.ttft_by_residency) - set(LEVELS))
            blocks.append(f"<h4>{_e(_trial_label(t))}</h4>")
            named = [(a, a) for a in adapters]
            blocks.append(
                _table(adapter_head, _percentile_rows(named, t.ttft_ms, t.e2e_ms), "pct")
                if adapters
                else "<p>no latencies measured</p>"
            )
            if levels:
                # Records without a reported residency are grouped under "None".
                named = [(lv, "not reported" if lv == "None" else lv) for lv in levels]
                rows = _percentile_rows(named, t.ttft_by_residency, None)
                blocks.append(_table(residency_head, rows, "pct"))
    least = ", ".join(f"{q} {MIN_SAMPLES[q]}" for q in quantiles)
    note = (
        f"<p>Latencies in ms. A percentile needs at least this many samples ({least}); below "
        "that it is shown as 'too few'.</p>"
    )
    return _section("Percentiles per trial", note + ("\n".join(blocks) or "<p>no trials</p>"))


def _trial_label(t: TrialResult) -> str:
    return (
        f"{t.cell} · {t.trial} · {t.profile} · {t.offered_rate:g} req/s · repetition {t.repetition}"
    )


# --- plots ------------------------------------------------------------------------------


def _plot(name: str, fig: Figure, caption: str) -> str:
    return (
        f'<figure class="plot" data-plot="{_e(name)}">\n{_svg(fig, name)}\n'
        f"<figcaption>{_e(caption)}</figcaption>\n</figure>"
    )


def _svg(fig: Figure, salt: str) -> str:
    """The figure as an inline ``<svg>`` element; ids salted per plot so they stay unique."""
    buffer = io.StringIO()
    with matplotlib.rc_context({"svg.fonttype": "none", "svg.hashsalt": salt}):
        fig.savefig(buffer, format="svg", dpi=150, metadata=NO_SVG_METADATA)
    text = buffer.getvalue()
    return text[text.index("<svg") :]


def _figure(width: float, height: float) -> Figure:
    """A figure on an Agg canvas, never registered with pyplot: nothing to close, no global
    backend switched, safe in any thread."""
    fig = Figure(figsize=(width, height), layout="constrained")
    FigureCanvasAgg(fig)
    return fig


def _message(text: str) -> Figure:
    fig = _figure(8, 1.6)
    fig.text(0.5, 0.5, text, ha="center", va="center", fontsize=13, color="#555555")
    return fig


def _label(text: str) -> str:
    """Plain text for a matplotlib label: a ``$`` must not start math mode."""
    return text.replace("$", r"\$")


def _natural_sorted(names: Iterable[str]) -> list[str]:
    def key(name: str) -> tuple[tuple[bool, int, str], ...]:
        return tuple(
            (p.isdigit(), int(p) if p.isdigit() else 0, p) for p in re.split(r"(\d+)", name)
        )

    return sorted(names, key=key)


def _answered(record: RequestRecord) -> bool:
    return ok(record) and record.ttft_ms is not None


def _ttft(record: RequestRecord) -> float:
    assert record.ttft_ms is not None
    return record.ttft_ms


def _log_if_positive(ax: Axes, values: Iterable[float]) -> None:
    if all(v > 0 for v in values):
        ax.set_yscale("log")


def _boxes(
    ax: Axes,
    data: list[list[float]],
    positions: list[float],
    colours: list[str],
    width: float = 0.6,
    fliers: bool = True,
) -> None:
    parts = ax.boxplot(
        data,
        positions=positions,
        widths=width,
        showfliers=fliers,
        patch_artist=True,
        medianprops={"color": "black", "linewidth": 1.2},
        flierprops={
            "marker": ".",
            "markersize": 3,
            "markerfacecolor": "#555555",
            "markeredgewidth": 0,
            "alpha": 0.5,
        },
    )
    for box, colour in zip(parts["boxes"], colours, strict=True):
        box.set_facecolor(colour)
        box.set_alpha(0.75)
    for line in parts["fliers"]:
        line.set_rasterized(len(line.get_xdata()) > RASTER_FROM)


def _ttft_by_adapter(requests: list[RequestRecord]) -> Figure:
    values: dict[str, dict[str, list[float]]] = defaultdict(lambda: defaultdict(list))
    for r in requests:
        if _answered(r):
            values[r.profile][r.adapter].append(_ttft(r))
    if not values:
        return _message("no completed requests")
    profiles = [p for p in PROFILES if p in values] + sorted(set(values) - set(PROFILES))
    adapters = _natural_sorted({a for by in values.values() for a in by})
    longest = max(len(a) for a in adapters)
    width = min(16.0, max(7.0, 1.5 + 0.6 * len(adapters)))
    fig = _figure(width, 0.3 + 2.3 * len(profiles) + min(3.0, 0.3 + 0.055 * longest))
    axes = fig.subplots(len(profiles), 1, sharex=True, sharey=True, squeeze=False)[:, 0]
    for ax, profile in zip(axes, profiles, strict=True):
        by = values[profile]
        shown = [i for i, a in enumerate(adapters) if by.get(a)]
        data = [by[adapters[i]] for i in shown]
        _boxes(ax, data, [float(i) for i in shown], ["#9ecae1"] * len(shown))
        ax.set_title(_label(f"profile: {profile}"), loc="left", fontsize=10, fontweight="bold")
        ax.set_ylabel("TTFT (ms)")
        ax.grid(axis="y", which="major", alpha=0.3)
        ax.margins(y=0.12)
        for i, adapter in enumerate(adapters):
            n = len(by.get(adapter, []))
            ax.text(
                i,
                0.97,
                f"n={n}",
                transform=ax.get_xaxis_transform(),
                ha="center",
                va="top",
                fontsize=7,
                color="#555555",
            )
    axes[-1].set_xticks(range(len(adapters)), [_label(a) for a in adapters])
    axes[-1].tick_params(axis="x", labelsize=8, labelrotation=35)
    for tick in axes[-1].get_xticklabels():
        tick.set_horizontalalignment("right")
        tick.set_rotation_mode("anchor")
    axes[-1].set_xlim(-0.6, len(adapters) - 0.4)
    _log_if_positive(axes[0], (v for by in values.values() for vs in by.values() for v in vs))
    return fig


def _ttft_by_residency(requests: list[RequestRecord]) -> Figure:
    values: dict[str, list[float]] = defaultdict(list)
    for r in requests:
        if _answered(r):
            values[r.residency_before or "unknown"].append(_ttft(r))
    if not values:
        return _message("no completed requests")
    levels = list(LEVELS) + sorted(set(values) - set(LEVELS))
    fig = _figure(8.5, 4.2)
    ax = fig.subplots()
    shown = [i for i, level in enumerate(levels) if values.get(level)]
    total = sum(min(STRIP_MAX, len(values[levels[i]])) for i in shown)
    colours = [RESIDENCY_COLOURS.get(levels[i], "#999999") for i in shown]
    # The box on the left of each slot, every request (or a sample of them) on the right.
    data = [values[levels[i]] for i in shown]
    _boxes(ax, data, [i - 0.18 for i in shown], colours, width=0.28, fliers=False)
    for i, colour in zip(shown, colours, strict=True):
        points = np.asarray(values[levels[i]])
        rng = np.random.default_rng(i)
        if len(points) > STRIP_MAX:
            points = rng.choice(points, STRIP_MAX, replace=False)
        ax.scatter(
            i + 0.18 + rng.uniform(-0.13, 0.13, len(points)),
            points,
            s=7,
            color=colour,
            alpha=0.45,
            linewidths=0,
            zorder=3,
            rasterized=total > RASTER_FROM,
        )
    labels = [_label(f"{level}\nn={len(values.get(level, []))}") for level in levels]
    ax.set_xticks(range(len(levels)), labels)
    ax.set_xlim(-0.6, len(levels) - 0.4)
    ax.set_xlabel("residency before arrival")
    ax.set_ylabel("TTFT (ms)")
    ax.grid(axis="y", alpha=0.3)
    _log_if_positive(ax, (v for vs in values.values() for v in vs))
    return fig


def _per_trial(results: Results, requests: list[RequestRecord]) -> dict[int, list[RequestRecord]]:
    """Records per trial (by ``id()`` of its ``TrialResult``)."""
    runs: dict[TrialKey, list[RequestRecord]] = defaultdict(list)
    for r in requests:
        runs[_key(r)].append(r)
    baseline = [results.baseline] if results.baseline is not None else []
    return {
        id(t): runs.get((t.cell, t.trial, t.profile, t.repetition, t.offered_rate), [])
        for cell in [*results.cells, *baseline]
        for t in cell.trials
    }


def _key(r: RequestRecord) -> TrialKey:
    return (r.cell, r.trial, r.profile, r.repetition, r.offered_rate)


def _reversal(results: Results, requests: list[RequestRecord]) -> str:
    trial = next(
        (t for cell in results.cells for t in cell.trials if t.profile == "reversal"), None
    )
    if trial is None:
        caption = "No trial of the popularity-reversal profile is in these results."
        return _plot("reversal-timeline", _message("no popularity-reversal trial"), caption)
    records = _per_trial(results, requests)[id(trial)]
    caption = (
        f"{_trial_label(trial)}: time to first token of each completed request at its "
        "scheduled arrival, coloured by residency before arrival; the dashed line is the "
        "reversal of the popularity ranking; the grey steps are the sampled queue depth. "
        "Only the first reversal trial is shown."
    )
    return _plot("reversal-timeline", _reversal_figure(trial, records), caption)


def _reversal_figure(trial: TrialResult, records: list[RequestRecord]) -> Figure:
    fig = _figure(11, 4.6)
    ax = fig.subplots()
    answered = [r for r in records if _answered(r)]
    handles: list[Any] = []
    for level in LEVELS:
        group = [r for r in answered if (r.residency_before or "unknown") == level]
        if group:
            ax.scatter(
                [r.arrival_s for r in group],
                [_ttft(r) for r in group],
                s=10,
                color=RESIDENCY_COLOURS[level],
                alpha=0.8,
                linewidths=0,
                zorder=3,
                rasterized=len(group) > RASTER_FROM,
                label=f"{level} ({len(group)})",
            )
    handles += ax.get_legend_handles_labels()[0]
    missing = [r for r in records if not _answered(r)]
    if missing:
        # Requests without an answer are a rug along the top: when they were due, not how long.
        ax.plot(
            [r.arrival_s for r in missing],
            [0.985] * len(missing),
            "|",
            color="#CC0000",
            markersize=8,
            transform=ax.get_xaxis_transform(),
            label=f"not completed ({len(missing)})",
        )
        handles.append(ax.get_legend_handles_labels()[0][-1])
    if trial.reversal_at_s is not None:
        before, after = trial.popular_before or "?", trial.popular_after or "?"
        ax.axvline(trial.reversal_at_s, color="black", linestyle="--", linewidth=1.2)
        handles.append(
            Line2D(
                [], [], color="black", linestyle="--", label=_label(f"reversal: {before} → {after}")
            )
        )
    ax.set_xlabel("scheduled arrival (s from the trial's start)")
    ax.set_ylabel("TTFT (ms)")
    ax.grid(alpha=0.3)
    if answered:
        _log_if_positive(ax, (_ttft(r) for r in answered))
    else:
        ax.text(0.5, 0.5, "no completed requests", transform=ax.transAxes, ha="center")
    if trial.queue_depth:
        depth = ax.twinx()
        depth.step(
            [s.t for s in trial.queue_depth],
            [s.value for s in trial.queue_depth],
            where="post",
            color="#666666",
            linewidth=1,
            alpha=0.75,
            label="queue depth",
        )
        depth.set_ylabel("queue depth (jobs)")
        depth.set_ylim(bottom=0)
        handles += depth.get_legend_handles_labels()[0]
    fig.legend(
        handles=handles,
        loc="outside upper center",
        ncols=min(len(handles), 5),
        fontsize=8,
        markerscale=2,
        frameon=False,
    )
    return fig


def _sweep_heatmap(results: Results, requests: list[RequestRecord]) -> Figure:
    if not results.cells:
        return _message("no cells")
    ttfts: dict[str, list[float]] = defaultdict(list)
    for r in requests:
        if _answered(r):
            ttfts[r.cell].append(_ttft(r))
    grid: dict[tuple[int, int, int], list[CellResult]] = defaultdict(list)
    for cell in results.cells:
        c = cell.config
        grid[(c.max_lora_rank, c.max_loras, c.max_cpu_loras)].append(cell)
    p95: dict[tuple[int, int, int], Percentiles] = {
        key: percentiles(v for cell in cells for v in ttfts[cell.id]) for key, cells in grid.items()
    }
    known = [p.p95 for p in p95.values() if p.p95 is not None]
    empty = Percentiles(n=0, p50=None, p95=None, p99=None)
    cmap = matplotlib.colormaps["viridis"]
    norm: Normalize = (
        LogNorm(min(known), max(known))
        if known and min(known) > 0 and max(known) > min(known)
        else Normalize(min(known, default=0.0), max(known, default=1.0))
    )
    ranks = sorted({rank for rank, _, _ in grid})
    sizes = [
        (
            sorted({lo for r, lo, _ in grid if r == rank}),
            sorted({c for r, _, c in grid if r == rank}),
        )
        for rank in ranks
    ]
    columns = max(len(cols) for _, cols in sizes)
    rows = max(len(lor) for lor, _ in sizes)
    fig = _figure(min(16.0, 1.6 + len(ranks) * (1.2 + 1.25 * columns)), 1.5 + 0.9 * rows)
    axes = fig.subplots(1, len(ranks), squeeze=False)[0]
    for ax, rank, (loras, cpus) in zip(axes, ranks, sizes, strict=True):
        for i, lora in enumerate(loras):
            for j, cpu in enumerate(cpus):
                key = (rank, lora, cpu)
                _heat_cell(ax, (j, i), grid.get(key, []), p95.get(key, empty), cmap, norm)
        ax.set_xlim(-0.5, len(cpus) - 0.5)
        ax.set_ylim(-0.5, len(loras) - 0.5)
        ax.set_xticks(range(len(cpus)), [str(c) for c in cpus])
        ax.set_yticks(range(len(loras)), [str(lo) for lo in loras])
        ax.set_xlabel("max_cpu_loras")
        ax.set_ylabel("max_loras", labelpad=8)
        ax.set_title(f"max_lora_rank {rank}", fontsize=10)
        ax.set_aspect("equal")
        ax.tick_params(length=0, pad=5)
        for spine in ax.spines.values():
            spine.set_visible(False)
    if known:
        bar = fig.colorbar(
            ScalarMappable(norm=norm, cmap=cmap), ax=list(axes), label="p95 TTFT (ms)", shrink=0.9
        )
        spread = np.geomspace if isinstance(norm, LogNorm) else np.linspace
        ticks = sorted({float(f"{v:.2g}") for v in spread(min(known), max(known), 5)})
        bar.set_ticks(ticks, labels=[f"{v:,.0f}" if v >= 100 else f"{v:g}" for v in ticks])
        bar.ax.minorticks_off()
    return fig


def _heat_cell(
    ax: Axes,
    xy: tuple[int, int],
    cells: list[CellResult],
    p: Percentiles,
    cmap: Colormap,
    norm: Normalize,
) -> None:
    """One square of the sweep heatmap: its p95, or why there is none."""
    x, y = xy
    edge, hatch, label_box = "#cccccc", "", False
    if not cells:
        fill, colour, text = "white", "#999999", "not run"
    elif all(cell.startup.outcome == "rejected" for cell in cells):
        fill, colour, text = "#d9d9d9", "black", "rejected"
        edge, hatch, label_box = "#8c8c8c", "///", True
        if p.p95 is not None:
            text += f"\n{_ms(p.p95)} ms before"
    elif p.p95 is None:
        fill, colour, text = "#f2f2f2", "#555555", f"too few\n(n={p.n})"
    else:
        rgb = to_rgb(cmap(norm(p.p95)))
        fill, edge = to_hex(rgb), "none"
        colour = "black" if 0.299 * rgb[0] + 0.587 * rgb[1] + 0.114 * rgb[2] > 0.5 else "white"
        text = f"{_ms(p.p95)} ms\nn={p.n}"
    square = Rectangle((x - 0.48, y - 0.48), 0.96, 0.96, facecolor=fill, edgecolor=edge)
    square.set_hatch(hatch)
    square.set_linewidth(0 if hatch else 0.8)
    ax.add_patch(square)
    box = {"facecolor": "white", "edgecolor": "none", "alpha": 0.85, "pad": 2}
    ax.text(
        x,
        y,
        text,
        ha="center",
        va="center",
        fontsize=9,
        color=colour,
        bbox=box if label_box else None,
    )


CSS = """
body { font: 15px/1.45 system-ui, -apple-system, "Segoe UI", Roboto, sans-serif;
  color: #1b1b1b; background: #fff; margin: 0; }
main { max-width: 1180px; margin: 0 auto; padding: 24px; }
h1 { font-size: 1.6em; margin: 0 0 8px; }
h2 { font-size: 1.3em; margin: 36px 0 12px; border-bottom: 2px solid #e4e4e4; padding-bottom: 4px; }
h3 { font-size: 1.08em; margin: 22px 0 6px; }
h4 { font-size: 0.95em; margin: 16px 0 4px; color: #333; }
small { font-weight: normal; color: #666; }
dl.facts { display: grid; grid-template-columns: max-content 1fr; gap: 2px 16px; margin: 0 0 12px; }
dl.facts dt { color: #666; }
dl.facts dd { margin: 0; font-family: ui-monospace, Menlo, Consolas, monospace; }
.verdict { font-size: 1.45em; font-weight: 700; padding: 14px 18px; border-radius: 6px;
  border-left: 8px solid; margin: 8px 0 12px; }
.verdict.go { background: #e8f5ec; border-color: #1a7f37; color: #0f5323; }
.verdict.caution { background: #fff6e0; border-color: #bf8700; color: #6b4a00; }
.verdict.stop { background: #fdecea; border-color: #cf222e; color: #82071e; }
.verdict.none { background: #f0f0f0; border-color: #888; color: #333; }
.scroll { overflow-x: auto; }
table { border-collapse: collapse; font-size: 0.85em; margin: 6px 0 10px; }
th, td { border: 1px solid #ddd; padding: 3px 6px; text-align: left; vertical-align: top; }
th { background: #f5f5f5; font-weight: 600; }
table.counts td, table.pct td { text-align: right; white-space: nowrap; }
table.counts td:first-child, table.pct td:first-child,
table.counts td:nth-child(2) { text-align: left; }
table.trials { font-size: 0.8em; }
tr.note td { text-align: left !important; white-space: normal !important; background: #fff8f8;
  color: #82071e; padding-left: 2em; }
tr.note ul { margin: 2px 0; }
table.counts td:nth-child(6) { text-align: left; }
table.decision td:nth-child(2) { max-width: 40em; }
td ul { margin: 0; padding-left: 1.1em; }
.decided { font-weight: 700; }
.fails { color: #cf222e; font-weight: 600; }
.muted { color: #777; }
pre { background: #f6f8fa; border: 1px solid #e1e4e8; border-radius: 4px; padding: 8px 10px;
  overflow-x: auto; font-size: 0.82em; white-space: pre-wrap; }
pre.error { border-color: #f1aeb5; background: #fff5f5; }
details.cell { margin: 10px 0; }
details.cell summary { cursor: pointer; padding: 2px 0; }
figure.plot { margin: 8px 0 20px; }
figure.plot svg { display: block; max-width: 100%; height: auto; }
figcaption { font-size: 0.88em; color: #555; margin-top: 6px; max-width: 60em; }
"""
