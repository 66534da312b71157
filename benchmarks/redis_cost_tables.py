"""The tables ``redis_cost.py`` prints, from its figures (a run's, or its JSON's)."""

from __future__ import annotations

from typing import Any

from rich.console import Console
from rich.markup import escape
from rich.table import Table

SIDES = ("gateway", "worker", "webhooks")
"""The services whose traffic the figures hold apart, in the order they are shown."""


def _f(value: float) -> str:
    return f"{value:,.2f}" if abs(value) < 100 else f"{value:,.0f}"


def side_table(title: str, figures: dict[str, Any], unit: str) -> Table:
    """Round trips, commands, script calls, connections and bytes by side and channel."""
    table = Table(title=title, title_justify="left")
    columns = ("round trips", "commands", "script calls", "connections opened", "KB up", "KB down")
    table.add_column("side / channel")
    for column in columns:
        table.add_column(
            column if column.startswith("conn") else f"{column} {unit}", justify="right"
        )
    totals = [0.0] * 4
    for side, channels in figures["sides"].items():
        for channel, tap in channels.items():
            commands = sum(tap["commands"].values())
            scripts = sum(tap["scripts"].values())
            table.add_row(
                f"{side} / {channel}",
                _f(tap["round_trips"]),
                _f(commands),
                _f(scripts),
                _f(tap["connections"]),
                _f(tap["bytes_up"] / 1024),
                _f(tap["bytes_down"] / 1024),
            )
            for i, value in enumerate((tap["round_trips"], commands, scripts, tap["connections"])):
                totals[i] += value
    table.add_row("all", *(_f(v) for v in totals), "", "", style="bold")
    return table


NOISE = 0.05
"""Per-job (or per-second) figures below this are left blank in the mix: background noise."""


def _cell(value: float) -> str:
    return _f(value) if abs(value) >= NOISE else ""


def mix_table(title: str, figures: dict[str, Any]) -> Table:
    """Commands by name, as each side and channel sent them and as scripts ran them; then
    script calls by script."""
    taps = [
        (f"{side}\n{channel}", tap)
        for side, channels in figures["sides"].items()
        for channel, tap in channels.items()
        if any(abs(v) >= NOISE for v in tap["commands"].values())
    ]
    table = Table(title=title, title_justify="left")
    table.add_column("command")
    for label, _ in taps:
        table.add_column(label, justify="right")
    table.add_column("inside\nscripts", justify="right")
    top, inside = figures["top_level"], figures["inside_scripts"]
    for name in sorted(set(top) | set(inside), key=lambda n: -(top.get(n, 0) + inside.get(n, 0))):
        cells = [_cell(tap["commands"].get(name, 0)) for _, tap in taps]
        if any(cells) or _cell(inside.get(name, 0)):
            table.add_row(escape(name), *cells, _cell(inside.get(name, 0)))
    scripts = sorted({name for _, tap in taps for name in tap["scripts"]})
    for name in scripts:
        cells = [_cell(tap["scripts"].get(name, 0)) for _, tap in taps]
        if any(cells):
            table.add_row(f"[dim]  script {escape(name)}[/dim]", *cells, "")
    return table


SUMMARY_COLUMNS = (
    "jobs", "ok", "HTTP\nreq", "RT\ngateway", "RT\nworker", "RT\nwebhooks", "RT\nall",
    "cmds\ntop-level", "cmds in\nscripts", "cmds\nall", "Redis\nCPU ms",
)  # fmt: skip


def summary_table(results: list[dict[str, Any]]) -> Table:
    """One row per path: round trips by side, commands sent and run inside scripts."""
    table = Table(title="Per job, net of background", title_justify="left")
    table.add_column("path", no_wrap=True)
    for column in SUMMARY_COLUMNS:
        table.add_column(column, justify="right")
    for result in results:
        per_job = result["per_job"]
        rts = {side: _round_trips(per_job, side) for side in SIDES}
        table.add_row(
            result["path"],
            str(result["jobs"]),
            str(result["ok"]),
            _f(result["http_requests"] / result["jobs"]),
            *(_f(rts[side]) for side in SIDES),
            _f(sum(rts.values())),
            _f(per_job["top_level_commands"]),
            _f(per_job["inside_script_commands"]),
            _f(per_job["server_commands"]),
            f"{per_job['redis_cpu_ms']:.3f}",
        )
    return table


def compare_table(before: dict[str, Any], after: dict[str, Any]) -> Table:
    """Round trips by side and commands per job, before -> after, for the paths both ran."""
    table = Table(title="Per job: before -> after", title_justify="left")
    table.add_column("path", no_wrap=True)
    for column in ("RT gateway", "RT worker", "RT webhooks", "commands", "Redis CPU ms"):
        table.add_column(column, justify="right")
    earlier = {result["path"]: result["per_job"] for result in before["paths"]}
    for result in after["paths"]:
        if result["path"] not in earlier:
            continue
        old, new = earlier[result["path"]], result["per_job"]
        cells = [
            f"{_f(_round_trips(old, side))} -> {_f(_round_trips(new, side))}" for side in SIDES
        ]
        cells.append(f"{_f(old['server_commands'])} -> {_f(new['server_commands'])}")
        cells.append(f"{old['redis_cpu_ms']:.3f} -> {new['redis_cpu_ms']:.3f}")
        table.add_row(result["path"], *cells)
    return table


def _round_trips(per_job: dict[str, Any], side: str) -> float:
    return float(sum(tap["round_trips"] for tap in per_job["sides"][side].values()))


def report(console: Console, measured: dict[str, Any]) -> None:
    """Background, then each path's sides and command mix, then the summary."""
    idle = measured["idle"]["per_second"]
    console.print(side_table("Background, per second (idle window)", idle, "/s"))
    console.print(mix_table("Background command mix, per second", idle))
    for result in measured["paths"]:
        figures = result["per_job"]
        title = f"{result['path']}: per job, net of background ({result['jobs']} jobs)"
        console.print(side_table(title, figures, "/job"))
        console.print(mix_table(f"{result['path']}: command mix per job", figures))
    console.print(summary_table(measured["paths"]))
