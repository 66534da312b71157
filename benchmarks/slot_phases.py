"""How the adapters shared the engine's slots, seen from the client: ``vllm serve`` and
lorafleet under the same closed-loop load, one after the other.

``vs_vllm_serve.py`` counts the engine's steps: at 64 requests at a time over 8 adapters and
4 slots, lorafleet's engine ran 13-72% more of them for the same tokens. This runs one of its
scenarios (``--scenario``, default ``stream c=64``) on both servers, A B per round, and
reads every request's send time, first and last text (streamed) or end (unstreamed) to
report, over the run:

- requests generating at once (first text to last), and adapters with one generating
  (at most ``max_loras``): slots held, and how full;
- callers waiting for their first text, and callers between requests (last text to the
  next send);
- first text for requests sent while their adapter had a request generating (they could
  join it) and for the others (their adapter needed a slot);
- activations per adapter (its requests generating went from none to some).

The same engine settings and fixtures as ``vs_vllm_serve.py`` (whose functions start both
servers). Streamed only for the generating-at-once figures: an unstreamed request has no
first text, so its whole time counts as waiting.

    .venv/bin/python benchmarks/slot_phases.py [--rounds 2] [--scenario "stream c=64"]
"""

from __future__ import annotations

import argparse
import asyncio
import shutil
import signal
import statistics
import tempfile
from pathlib import Path

import vs_vllm_serve as pair
from openai_load import Run, Scenario, run
from rich.console import Console
from rich.table import Table

from lorafleet.fixtures import write_fixtures
from lorafleet.processes import interrupt_on_signal


def _quantile(values: list[float], q: float) -> float | None:
    ordered = sorted(values)
    return ordered[int(q * (len(ordered) - 1))] if ordered else None


def phases(scenario: Scenario, result: Run) -> dict[str, float | None]:
    """The figures in the module's docstring, from one run's outcomes."""
    spans = [  # (first text, last text, adapter, sent), wall clock
        (o.sent_at + o.first_s, o.sent_at + o.last_s, adapter, o.sent_at)
        for (adapter, _), o in zip(scenario.work, result.outcomes, strict=True)
        if o.error is None and o.first_s is not None and o.last_s is not None
    ]
    if not spans:
        return {}
    start = min(sent for *_, sent in spans)
    end = max(last for _, last, *_ in spans)
    events = sorted(
        [(first, 1, adapter) for first, _, adapter, _ in spans]
        + [(last, -1, adapter) for _, last, adapter, _ in spans]
    )
    generating: dict[str, int] = {}
    activations: dict[str, int] = {}
    at, requests_s, adapters_s = start, 0.0, 0.0
    for when, change, adapter in events:
        requests_s += (when - at) * sum(generating.values())
        adapters_s += (when - at) * sum(1 for n in generating.values() if n)
        at = when
        if change > 0 and not generating.get(adapter):
            activations[adapter] = activations.get(adapter, 0) + 1
        generating[adapter] = generating.get(adapter, 0) + change
    waiting_s = sum(first - sent for first, _, _, sent in spans)
    could_join, needed_slot = [], []
    for first, _, adapter, sent in spans:
        busy = any(a == adapter and f <= sent < last for f, last, a, _ in spans)
        (could_join if busy else needed_slot).append((first - sent) * 1000)
    length = end - start
    callers = scenario.concurrency
    return {
        "run s": length,
        "generating at once": requests_s / length,
        "adapters generating": adapters_s / length,
        "callers waiting for first text": waiting_s / length,
        "callers between requests": callers - (requests_s + waiting_s) / length,
        "sent while its adapter generated (could join)": len(could_join),
        "  their first text p50 ms": _quantile(could_join, 0.5),
        "  their first text p90 ms": _quantile(could_join, 0.9),
        "sent while its adapter did not (needed a slot)": len(needed_slot),
        "  their first text p50 ms (needed a slot)": _quantile(needed_slot, 0.5),
        "  their first text p90 ms (needed a slot)": _quantile(needed_slot, 0.9),
        "activations per adapter": statistics.mean(activations.values()),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=2, help="A B rounds (vLLM, then lorafleet)")
    parser.add_argument("--scenario", default="stream c=64", help="stream c=N")
    parser.add_argument("--requests", type=int, default=256)
    args = parser.parse_args()
    kind, _, concurrency = args.scenario.partition(" c=")
    if kind != "stream" or not concurrency.isdigit():
        parser.error('--scenario: "stream c=N" (the figures need first and last text)')
    console = Console(width=170)
    signal.signal(signal.SIGTERM, interrupt_on_signal)

    from transformers import AutoTokenizer

    scratch = Path(tempfile.mkdtemp(prefix="lorafleet-slot-phases-"))
    try:
        specs = write_fixtures(scratch / "fixtures", adapters=pair.ADAPTERS)
        model = scratch / "fixtures" / "base"
        adapters = {spec.name: scratch / "fixtures" / "adapters" / spec.name for spec in specs}
        tokenizer = AutoTokenizer.from_pretrained(model)
        shape = argparse.Namespace(
            concurrency=[int(concurrency)], requests=args.requests, single_requests=1,
            short_requests=0,
        )  # fmt: skip
        (scenario,) = [s for s in pair.plan(tokenizer, sorted(adapters), shape) if s.stream]
        warming = (sorted(adapters), pair.exact_prompts(tokenizer, 1, seed=11)[0])
        columns: dict[str, dict[str, float | None]] = {}
        for round_ in range(1, args.rounds + 1):
            for name in (pair.VLLM, pair.LORAFLEET):
                console.print(f"round {round_}/{args.rounds} {name}: starting", markup=False)
                starting = (
                    pair.vllm_serve(model, adapters, scratch / "logs", console, colocated=True)
                    if name == pair.VLLM
                    else pair.lorafleet_stack(model, adapters, scratch / f"stack-{round_}")
                )
                with starting as server:
                    asyncio.run(pair.warm(server, *warming, 600))
                    result = asyncio.run(run(server.url, server.headers, scenario, 600))
                columns[f"{name} {round_}"] = phases(scenario, result)
    finally:
        shutil.rmtree(scratch, ignore_errors=True)
    table = Table(title=f"{scenario.name}, {args.requests} requests, {pair.ADAPTERS} adapters")
    table.add_column("")
    for column in columns:
        table.add_column(column, justify="right")
    for row in next(iter(columns.values())):
        cells = [columns[c].get(row) for c in columns]
        table.add_row(row, *("-" if v is None else f"{v:,.1f}" for v in cells))
    console.print(table)


if __name__ == "__main__":
    main()
