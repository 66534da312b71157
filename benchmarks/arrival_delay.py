"""``vllm serve`` with requests reaching it late: what a delay between a request's end and its
caller's next request costs vLLM's batching when adapters share slots.

At 64 streamed requests at a time over 8 adapters and 4 slots (``slot_phases.py``),
lorafleet's engine runs 13-72% more steps than ``vllm serve``'s for the same tokens, under
every slot rule tried, vLLM's own included. On lorafleet a request reaches a worker some time
after it was sent (gateway, queue, claim: ``profile_stack.py`` prints the split; at 64 at a
time on a 2-core machine, about 150 ms at the median and 370 ms at p90, adding the stages'
percentiles); on ``vllm serve`` at once. This puts such a delay, and nothing else of
lorafleet, in front of ``vllm serve``: one server, the same closed-loop load as
``vs_vllm_serve.py --concurrency N`` (``--scenario``), and before each send its caller waits
for a delay drawn from one of ``--delays``:

- ``none``: sends at once, as ``vs_vllm_serve.py`` does;
- ``uniform:MS``: uniform between 0 and ``MS`` ms (a spread, as a queue-fed service's);
- ``constant:MS``: ``MS`` ms every time (the same mean as ``uniform:2MS``, no spread).

Each round runs every delay once, in an order rotated per round, each on prompts of its own
(no prefix cache hit between runs). Per run: the engine's steps and tokens per step (vLLM's
own ``vllm:iteration_tokens_total``), wall time, and ``slot_phases.phases``' figures; a
request's times start after its delay (first text is the server's, not the caller's wait).
The last table gives each delay's steps and wall time over those of ``none`` in the same
round. Steps are the figure to read: wall time also holds the callers' own waits (the mean
delay times the requests each caller sends).

    .venv/bin/python benchmarks/arrival_delay.py [--rounds 3]
        [--delays none uniform:300 constant:150] [--scenario "stream c=64"] [--requests 256]
        [--json FILE]
"""

from __future__ import annotations

import argparse
import asyncio
import dataclasses
import json
import random
import shutil
import signal
import statistics
import tempfile
from collections.abc import Callable
from pathlib import Path

import slot_phases
import vs_vllm_serve as pair
from openai_load import run
from rich.console import Console
from rich.table import Table

from lorafleet.fixtures import write_fixtures
from lorafleet.processes import interrupt_on_signal

NONE = "none"


def pause_of(spec: str, rng: random.Random) -> Callable[[], float] | None:
    """The caller's wait before each send (seconds) for a ``--delays`` entry."""
    if spec == NONE:
        return None
    kind, _, ms = spec.partition(":")
    try:
        bound = float(ms) / 1000
    except ValueError:
        bound = -1.0
    if bound < 0 or kind not in ("uniform", "constant"):
        raise argparse.ArgumentTypeError(f"{spec!r}: none, uniform:MS or constant:MS (MS >= 0)")
    if kind == "uniform":
        return lambda: rng.uniform(0, bound)
    return lambda: bound


def median_of(values: list[float | None]) -> float | None:
    found = [v for v in values if v is not None]
    return statistics.median(found) if found else None


def ratio_of(value: float | None, base: float | None) -> float | None:
    return value / base if value is not None and base else None


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--delays", nargs="+", default=[NONE, "uniform:300", "constant:150"])
    parser.add_argument("--scenario", default="stream c=64", help="stream c=N")
    parser.add_argument("--requests", type=int, default=256)
    parser.add_argument("--json", type=Path, help="also write the results here")
    args = parser.parse_args()
    kind, _, concurrency = args.scenario.partition(" c=")
    if kind != "stream" or not concurrency.isdigit() or int(concurrency) < 1:
        parser.error('--scenario: "stream c=N" (the figures need first and last text)')
    if args.rounds < 1 or len(set(args.delays)) != len(args.delays):
        parser.error("--rounds >= 1, and each delay once")
    rng = random.Random(5)
    try:
        pauses = {spec: pause_of(spec, rng) for spec in args.delays}
    except argparse.ArgumentTypeError as exc:
        parser.error(f"--delays: {exc}")
    console = Console(width=170)
    signal.signal(signal.SIGTERM, interrupt_on_signal)

    from transformers import AutoTokenizer

    scratch = Path(tempfile.mkdtemp(prefix="lorafleet-arrival-delay-"))
    runs: dict[tuple[str, int], dict[str, float | None]] = {}
    try:
        specs = write_fixtures(scratch / "fixtures", adapters=pair.ADAPTERS)
        model = scratch / "fixtures" / "base"
        adapters = {spec.name: scratch / "fixtures" / "adapters" / spec.name for spec in specs}
        names = sorted(adapters)
        tokenizer = AutoTokenizer.from_pretrained(model)
        shape = argparse.Namespace(
            concurrency=[int(concurrency)], requests=args.requests,
            single_requests=args.requests, short_requests=0,
        )  # fmt: skip
        (scenario,) = [s for s in pair.plan(tokenizer, names, shape) if s.stream]
        warming = (names, pair.exact_prompts(tokenizer, 1, seed=11)[0])
        console.print(f"{pair.VLLM}: starting", markup=False)
        with pair.start(pair.VLLM, model, adapters, scratch, 1, console, True) as server:
            asyncio.run(pair.warm(server, *warming, 600))
            seed = 1000
            for round_ in range(1, args.rounds + 1):
                shift = (round_ - 1) % len(args.delays)
                for spec in args.delays[shift:] + args.delays[:shift]:
                    seed += 1
                    prompts = pair.exact_prompts(tokenizer, len(scenario.work), seed=seed)
                    work = tuple(
                        (names[i % len(names)], prompt) for i, prompt in enumerate(prompts)
                    )
                    this = dataclasses.replace(scenario, work=work)
                    before = pair.engine_steps(server, console)
                    result = asyncio.run(run(server.url, {}, this, 600, pauses[spec]))
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

    title = f"{pair.VLLM}, {scenario.name}, {args.requests} requests, {pair.ADAPTERS} adapters, "
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
    for heading in columns:
        table.add_column(heading, justify="right")
    for (spec, round_), figures in runs.items():
        cells = [figures.get(row) for row in list(columns.values())[2:]]
        table.add_row(spec, str(round_), *("-" if v is None else f"{v:,.1f}" for v in cells))
    console.print(table)

    ratios = Table(title=f"over {NONE} in the same round (median of {args.rounds} rounds)")
    for heading in ("delay", "engine steps", "wall time", "first text p50 ms (needed a slot)"):
        ratios.add_column(heading, justify="right")
    rounds = range(1, args.rounds + 1)

    def over(spec: str, row: str) -> float | None:
        if NONE not in args.delays:
            return None
        return median_of(
            [ratio_of(runs[(spec, r)].get(row), runs[(NONE, r)].get(row)) for r in rounds]
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
                    "scenario": scenario.name,
                    "requests": args.requests,
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
