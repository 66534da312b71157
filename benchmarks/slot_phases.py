"""How the adapters shared the engine's slots, seen from the client: ``vllm serve`` and
lorafleet under the same closed-loop load, one after the other.

``vs_vllm_serve.py`` counts the engine's steps: at 64 requests at a time over 8 adapters and
4 slots, lorafleet's engine ran 13-72% more of them for the same tokens. This runs one of its
streamed scenarios (``--scenario``, default ``stream c=64``; streamed only: the figures need
each request's first and last text) on both servers, A B per round, and from every request's
send time, first and last text reports, time-averaged over the steady window (from the first
send to the last: every caller has work; the whole run when all are sent at once):

- requests streaming at once (first text to last), and adapters with a request streaming
  (as the client saw it: delivery lag can show a fifth adapter for a moment);
- callers waiting for their first text, and callers idle (last text to the next send);
- first text of the requests sent while a request of their adapter was streaming (their
  adapter held a slot, as far as the client could tell) and of the others;
- activations per adapter (its requests streaming went from none to some), over the run;
- the engine's steps during the scenario (``vs_vllm_serve.engine_steps``).

The same engine settings, fixtures and prompts as ``vs_vllm_serve.py --concurrency N``
(whose functions start both servers).

    .venv/bin/python benchmarks/slot_phases.py [--rounds 2] [--scenario "stream c=64"]
        [--requests 256]
"""

from __future__ import annotations

import argparse
import asyncio
import shutil
import signal
import tempfile
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import vs_vllm_serve as pair
from openai_load import Run, Scenario, percentile, run
from rich.console import Console
from rich.table import Table

from lorafleet.fixtures import write_fixtures
from lorafleet.processes import interrupt_on_signal


def phases(scenario: Scenario, result: Run) -> dict[str, float | None]:
    """The figures in the module's docstring, from one run's outcomes."""
    spans = [  # (first text, last text, adapter, sent), wall clock
        (o.sent_at + o.first_s, o.sent_at + o.last_s, adapter, o.sent_at)
        for (adapter, _), o in zip(scenario.work, result.outcomes, strict=True)
        if o.error is None and o.first_s is not None and o.last_s is not None
    ]
    failed = len(result.outcomes) - len(spans)
    if not spans:
        return {"failed": failed}
    start = min(sent for *_, sent in spans)
    if scenario.concurrency >= len(scenario.work):  # all sent at once: the whole run
        stop = max(last for _, last, *_ in spans)
    else:  # to the last send: past it, callers run out of work
        stop = max(sent for *_, sent in spans)
    length = stop - start

    def within(a: float, b: float) -> float:
        return max(0.0, min(b, stop) - max(a, start))

    # At one instant an end goes before a start of the same adapter (a request streamed in
    # one chunk has first == last), so a count never goes below zero.
    events = sorted(
        [(first, 1, adapter) for first, _, adapter, _ in spans]
        + [(last, -1, adapter) for _, last, adapter, _ in spans],
        key=lambda event: (event[0], -event[1]),
    )
    streaming: dict[str, int] = {}
    activations: dict[str, int] = {}
    at, requests_s, adapters_s = start, 0.0, 0.0
    for when, change, adapter in events:
        requests_s += within(at, when) * sum(streaming.values())
        adapters_s += within(at, when) * sum(1 for n in streaming.values() if n)
        at = when
        if change > 0 and not streaming.get(adapter):
            activations[adapter] = activations.get(adapter, 0) + 1
        streaming[adapter] = streaming.get(adapter, 0) + change
    waiting_s = sum(within(sent, first) for first, _, _, sent in spans)
    slot_held: list[float] = []
    slot_needed: list[float] = []
    for i, (first, _, adapter, sent) in enumerate(spans):
        held = any(
            j != i and other == adapter and f <= sent < last
            for j, (f, last, other, _) in enumerate(spans)
        )
        (slot_held if held else slot_needed).append((first - sent) * 1000)
    return {
        "failed": failed,
        "window s (steady, or whole if all sent at once)": length,
        "requests streaming at once": requests_s / length,
        "adapters with one streaming": adapters_s / length,
        "callers waiting for first text": waiting_s / length,
        "callers idle (last text to next send)": scenario.concurrency
        - (requests_s + waiting_s) / length,
        "sent while its adapter streamed: requests": len(slot_held),
        "  their first text p50 ms": percentile(slot_held, 50),
        "  their first text p90 ms": percentile(slot_held, 90),
        "sent while it did not: requests": len(slot_needed),
        "  their first text p50 ms (did not)": percentile(slot_needed, 50),
        "  their first text p90 ms (did not)": percentile(slot_needed, 90),
        "activations per adapter (whole run)": sum(activations.values())
        / len({adapter for adapter, _ in scenario.work}),
    }


def streamed_scenario(parser: argparse.ArgumentParser, text: str) -> int:
    """The concurrency of a ``--scenario`` given as "stream c=N" (else ``parser.error``)."""
    kind, _, concurrency = text.partition(" c=")
    if kind != "stream" or not concurrency.isdigit() or int(concurrency) < 1:
        parser.error('--scenario: "stream c=N" (the figures need first and last text)')
    return int(concurrency)


@dataclass(frozen=True)
class Setup:
    """The fixtures of ``vs_vllm_serve.py`` in a scratch directory, one streamed scenario on
    them (its prompts: ``vs_vllm_serve.plan``'s), and a prompt to warm a server with."""

    model: Path
    adapters: dict[str, Path]
    tokenizer: Any
    scenario: Scenario
    warming: tuple[list[str], str]


def setup(scratch: Path, concurrency: int, requests: int) -> Setup:
    from transformers import AutoTokenizer

    specs = write_fixtures(scratch / "fixtures", adapters=pair.ADAPTERS)
    model = scratch / "fixtures" / "base"
    adapters = {spec.name: scratch / "fixtures" / "adapters" / spec.name for spec in specs}
    tokenizer = AutoTokenizer.from_pretrained(model)
    shape = argparse.Namespace(
        concurrency=[concurrency], requests=requests, single_requests=requests, short_requests=0
    )
    (scenario,) = [s for s in pair.plan(tokenizer, sorted(adapters), shape) if s.stream]
    warming = (sorted(adapters), pair.exact_prompts(tokenizer, 1, seed=11)[0])
    return Setup(model, adapters, tokenizer, scenario, warming)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=2, help="A B rounds (vLLM, then lorafleet)")
    parser.add_argument("--scenario", default="stream c=64", help="stream c=N")
    parser.add_argument("--requests", type=int, default=256)
    args = parser.parse_args()
    concurrency = streamed_scenario(parser, args.scenario)
    console = Console(width=170)
    signal.signal(signal.SIGTERM, interrupt_on_signal)

    scratch = Path(tempfile.mkdtemp(prefix="lorafleet-slot-phases-"))
    try:
        ready = setup(scratch, concurrency, args.requests)
        model, adapters, scenario = ready.model, ready.adapters, ready.scenario
        columns: dict[str, dict[str, float | None]] = {}
        for round_ in range(1, args.rounds + 1):
            for name in (pair.VLLM, pair.LORAFLEET):
                console.print(f"round {round_}/{args.rounds} {name}: starting", markup=False)
                with pair.start(name, model, adapters, scratch, round_, console, True) as server:
                    asyncio.run(pair.warm(server, *ready.warming, 600))
                    before = pair.engine_steps(server, console)
                    result = asyncio.run(run(server.url, server.headers, scenario, 600))
                    after = pair.engine_steps(server, console)
                column = phases(scenario, result)
                column["engine steps"] = pair.steps_between(before, after)[0]
                columns[f"{name} {round_}"] = column
    finally:
        shutil.rmtree(scratch, ignore_errors=True)
    title = f"{scenario.name}, {args.requests} requests, {pair.ADAPTERS} adapters, "
    table = Table(title=title + f"max_loras {pair.ENGINE['max_loras']}")
    table.add_column("")
    for heading in columns:
        table.add_column(heading, justify="right")
    for row in max(columns.values(), key=len):
        cells = [figures.get(row) for figures in columns.values()]
        table.add_row(row, *("-" if v is None else f"{v:,.1f}" for v in cells))
    console.print(table)


if __name__ == "__main__":
    main()
