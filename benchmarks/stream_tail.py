"""How long a streamed completion takes past its last token, beside the same request unstreamed.

One client sends sequential 8-token completions (greedy, ``ignore_eos``) on one hot adapter,
alternating ``stream: true`` and ``stream: false``, so a drifting box moves both alike. For
each streamed one it records the time to the first content chunk, to the last content
chunk, and to ``[DONE]``; the tail (``[DONE]`` minus the last content chunk) is what a
stream costs after the engine finished. The ratio compares end-to-end times, streamed over
unstreamed: a stream that ends when its job does costs about what the unstreamed request
does.

    .venv/bin/python benchmarks/stream_tail.py [--requests 40]

CPU: client, gateway, Redis, worker and engine share this machine's cores; the per-process
CPU seconds of the run are printed.
"""

from __future__ import annotations

import argparse
import json
import shutil
import statistics
import tempfile
import time
from pathlib import Path

import httpx
import psutil
from rich.console import Console
from rich.progress import track
from rich.table import Table

from contracts.queues import Tier
from lorafleet.client import auth_headers
from lorafleet.fixtures import write_fixtures
from lorafleet.settings import LocalSettings
from lorafleet.stack import LocalStack

PROMPT = "extract the total amount due"
TOKENS = 8


def streamed(client: httpx.Client, model: str) -> tuple[float, float, float, float]:
    """(first chunk, last content chunk, [DONE], end) in ms from the request's start."""
    body = {"model": model, "prompt": PROMPT, "max_tokens": TOKENS, "temperature": 0,
            "ignore_eos": True, "stream": True}  # fmt: skip
    start = time.perf_counter()
    first = last = done = 0.0
    with client.stream("POST", "/v1/completions", json=body) as response:
        response.raise_for_status()
        for line in response.iter_lines():
            now = (time.perf_counter() - start) * 1000
            if not line.startswith("data: "):
                continue
            data = line.removeprefix("data: ")
            if data == "[DONE]":
                done = now
                continue
            choices = json.loads(data).get("choices") or []
            if choices and choices[0].get("text"):
                first = first or now
                last = now
    return first, last, done, (time.perf_counter() - start) * 1000


def unstreamed(client: httpx.Client, model: str) -> float:
    body = {"model": model, "prompt": PROMPT, "max_tokens": TOKENS, "temperature": 0,
            "ignore_eos": True}  # fmt: skip
    start = time.perf_counter()
    client.post("/v1/completions", json=body).raise_for_status()
    return (time.perf_counter() - start) * 1000


def cpu_by_process(stack: LocalStack) -> dict[str, float]:
    seconds = {}
    for child in stack.children:
        try:
            process = psutil.Process(child.pid)
            total = sum(process.cpu_times()[:2])
            total += sum(sum(c.cpu_times()[:2]) for c in process.children(recursive=True))
        except psutil.Error:
            continue
        seconds[child.name] = total
    return seconds


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--requests", type=int, default=40, help="of each kind")
    args = parser.parse_args()
    console = Console(width=120)
    scratch = Path(tempfile.mkdtemp(prefix="lorafleet-bench-"))
    try:
        specs = write_fixtures(scratch / "fixtures", adapters=1)
        model = specs[0].name
        settings = LocalSettings(state_dir=scratch / "state")
        with LocalStack(settings, scratch / "fixtures" / "base") as stack:
            stack.start_infra()
            stack.publisher().publish(scratch / "fixtures" / "adapters" / model, model, Tier.HOT)
            console.print("starting gateway and worker")
            stack.start_services()
            with httpx.Client(
                base_url=stack.gateway_url, headers=auth_headers(stack.api_key), timeout=120
            ) as client:
                for _ in range(3):  # warm: adapter resident, tokenizer cached, pools open
                    streamed(client, model)
                    unstreamed(client, model)
                before = cpu_by_process(stack)
                streams, plains = [], []
                for _ in track(range(args.requests), description="requests", console=console):
                    streams.append(streamed(client, model))
                    plains.append(unstreamed(client, model))
                after = cpu_by_process(stack)
    finally:
        shutil.rmtree(scratch, ignore_errors=True)

    def p50(values: list[float]) -> float:
        return statistics.median(values)

    table = Table(title=f"{args.requests} x ({TOKENS}-token completion, streamed and not), p50 ms")
    for column in ("", "first token", "last token", "[DONE]", "tail", "end to end"):
        table.add_column(column, justify="left" if not column else "right")
    table.add_row(
        "streamed",
        f"{p50([s[0] for s in streams]):.1f}",
        f"{p50([s[1] for s in streams]):.1f}",
        f"{p50([s[2] for s in streams]):.1f}",
        f"{p50([s[2] - s[1] for s in streams]):.1f}",
        f"{p50([s[3] for s in streams]):.1f}",
    )
    table.add_row("unstreamed", "", "", "", "", f"{p50(plains):.1f}")
    console.print(table)
    ratio = p50([s[3] for s in streams]) / p50(plains)
    console.print(f"end to end, streamed / unstreamed (p50): {ratio:.2f}x")
    console.print(
        "CPU s during the measured requests: "
        + ", ".join(f"{name} {after[name] - before.get(name, 0):.2f}" for name in sorted(after))
    )


if __name__ == "__main__":
    main()
