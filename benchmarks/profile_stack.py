"""Where the control plane's CPU goes: py-spy on the gateway and the worker under one load.

Starts the local stack as ``vs_vllm_serve.py`` does (8 adapters, 64 tokens in and out), warms
it, runs the scenario once unprofiled (CPU seconds of each process), then again with
``py-spy record`` attached to the gateway and to the worker's main process (the engine core
is a process of its own and not sampled), and prints, per process, the frames holding the
most samples (inclusive, and where the time was spent). The raw collapsed stacks are kept in
``--out`` for a flame graph (``flamegraph.pl`` or speedscope read them).

    .venv/bin/python benchmarks/profile_stack.py --scenario stream --concurrency 256

Samples only while the process holds the GIL (``--gil``): what costs CPU in Python, not what
waits. py-spy walks every thread at each sample; the worker has a Celery thread per job slot
(256), so it is sampled far less often than asked (tens of samples in a few seconds): read
the worker's shares as coarse, and its sample count is printed with them.

The unprofiled run also prints where a request's time went: sent -> accepted by the gateway,
-> claimed by a worker, -> first text in Redis (the engine's own time to first token beside
it), -> first text at the client (streamed; unstreamed: -> outcome stored -> answer), from the
client's clock, the job's record and its stream's entry ids (one machine, one clock); and
sent -> claimed, and sent -> ready for the engine (the slot wait left out), end to end per
request: the delay ``arrival_delay.py`` puts in front of ``vllm serve``, written per request
with ``--arrivals FILE``.
"""

from __future__ import annotations

import argparse
import asyncio
import collections
import datetime
import json
import shutil
import signal
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Any

from openai_load import Run, Scenario, percentile, run, summarise
from redis import Redis
from rich.console import Console
from rich.table import Table
from vs_vllm_serve import ADAPTERS, NEW_TOKENS, cpu_now, exact_prompts, lorafleet_stack, warm

from contracts.keys import job_key, stream_key
from lorafleet.fixtures import write_fixtures
from lorafleet.processes import interrupt_on_signal

SAMPLED = ("gateway", "worker")
COMMON = 0.8
"""Frames (nearly) every sample shares, the interpreter's entry and uvicorn's or Celery's
start-up, are left out of the inclusive table: those in more than this share of the samples,
unless they are the project's own."""


def py_spy() -> str:
    found = shutil.which("py-spy") or str(Path(sys.executable).with_name("py-spy"))
    if not Path(found).exists():
        raise SystemExit("py-spy not found: .venv/bin/pip install py-spy (it is in the dev extra)")
    return found


def record(spy: str, pid: int, rate: int, output: Path) -> subprocess.Popen[bytes]:
    """py-spy sampling ``pid`` while it holds the GIL, until sent SIGINT."""
    argv = [spy, "record", "--pid", str(pid), "--rate", str(rate), "--gil"]
    argv += ["--format", "raw", "--output", str(output)]
    return subprocess.Popen(argv, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)


def shares(path: Path) -> tuple[int, collections.Counter[str], collections.Counter[str]]:
    """Samples, and samples per frame: inclusive (a frame anywhere in the stack) and leaf."""
    inclusive: collections.Counter[str] = collections.Counter()
    leaf: collections.Counter[str] = collections.Counter()
    total = 0
    for line in path.read_text().splitlines():
        stack, _, count = line.rpartition(" ")
        if not stack:
            continue
        frames = stack.split(";")
        total += int(count)
        leaf[frames[-1]] += int(count)
        for frame in set(frames):
            inclusive[frame] += int(count)
    return total, inclusive, leaf


def ours(frame: str) -> bool:
    """A frame of the project's own modules (not ``celery/worker/...``)."""
    return any(f"({package}/" in frame for package in ("gateway", "worker", "contracts"))


def table(name: str, path: Path, cpu_s: float, top: int) -> Table:
    total, inclusive, leaf = shares(path)
    result = Table(title=f"{name}: {total} samples holding the GIL, {cpu_s:.2f} CPU s unprofiled")
    result.add_column("inclusive", justify="right")
    result.add_column("frame")
    result.add_column("leaf (self)", justify="right")
    result.add_column("frame ")
    shown = [
        (frame, count)
        for frame, count in inclusive.most_common()
        if ours(frame) or count <= total * COMMON
        if not frame.startswith("thread (")
    ][:top]
    leaves = leaf.most_common(top)
    for row in range(top):
        cells = []
        for entries in (shown, leaves):
            if row < len(entries):
                frame, count = entries[row]
                cells += [f"{count / max(total, 1):.1%}", frame[:90]]
            else:
                cells += ["", ""]
        result.add_row(*cells)
    return result


def _seconds(iso: str) -> float:
    return datetime.datetime.fromisoformat(iso).timestamp()


def timeline(result: Run, redis_url: str) -> tuple[Table, list[float]]:
    """Where a request's time went, p50 and p90 over the successful ones (ms), from the
    client's clock, the job's record (accepted, claimed: the gateway's and the worker's
    clocks) and its stream (each entry's id is Redis's clock): one machine, one clock. And
    each request's arrival (s): from its send to the moment the worker would have handed it
    to the engine but for the adapter-slot gate (accepted, then the queue wait to the job's
    start on the worker and its time to the engine, less the slot wait), the delay
    ``arrival_delay.py`` can put in front of ``vllm serve``."""
    columns: dict[str, list[float]] = collections.defaultdict(list)
    arrivals: list[float] = []
    good = [o for o in result.outcomes if o.error is None and o.job_id and o.metadata]
    with Redis.from_url(redis_url, decode_responses=True) as redis:
        for outcome in good:
            record = json.loads(str(redis.hget(job_key(str(outcome.job_id)), "record")))
            accepted = _seconds(record["created_at"])
            claimed = _seconds(record["started_at"])
            columns["gateway: sent -> accepted"].append(accepted - outcome.sent_at)
            columns["admitted -> a worker claimed it"].append(claimed - accepted)
            columns["sent -> claimed (end to end)"].append(claimed - outcome.sent_at)
            if outcome.first_s is not None:
                entries: Any = redis.xrange(stream_key(str(outcome.job_id)))
                texts = [int(i.split("-")[0]) / 1000 for i, fields in entries if "text" in fields]
                columns["worker: claimed -> first text in Redis"].append(texts[0] - claimed)
                columns["gateway: first text in Redis -> client"].append(
                    outcome.sent_at + outcome.first_s - texts[0]
                )
                columns["client: first text"].append(outcome.first_s)
            else:
                finished = _seconds(record["finished_at"])
                columns["worker: claimed -> outcome stored"].append(finished - claimed)
                columns["gateway: outcome stored -> client"].append(
                    outcome.sent_at + outcome.e2e_s - finished
                )
            metadata: dict[str, Any] = outcome.metadata  # type: ignore[assignment]
            for field, name in (
                ("to_engine_ms", "worker: job started (after its claim) -> in the engine"),
                ("slot_wait_ms", "  of it, waiting for an adapter slot"),
                ("ttft_ms", "engine's own: arrival -> first token"),
            ):
                if metadata.get(field) is not None:
                    columns[name].append(metadata[field] / 1000)
            if metadata.get("to_engine_ms") is not None:
                # From acceptance to the job's start on the worker (the claim included), then
                # to the engine, less the slot wait: one clock from ``accepted_at`` on.
                worker_ms = metadata["queue_wait_ms"] + metadata["to_engine_ms"]
                ready = worker_ms - (metadata.get("slot_wait_ms") or 0)
                arrivals.append(accepted - outcome.sent_at + ready / 1000)
                columns["sent -> ready for the engine (slot wait left out)"].append(arrivals[-1])
            columns["client: whole request"].append(outcome.e2e_s)
    out = Table(title=f"where a request's time went ({len(good)} requests, ms)")
    for heading in ("", "p50", "p90"):
        out.add_column(heading, justify="left" if not heading else "right")
    for name, values in columns.items():
        p50, p90 = percentile(values, 50), percentile(values, 90)
        out.add_row(name, *("-" if v is None else f"{v * 1000:,.1f}" for v in (p50, p90)))
    return out, arrivals


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--scenario", choices=["stream", "no-stream"], default="stream")
    parser.add_argument("--concurrency", type=int, default=256)
    parser.add_argument("--requests", type=int, default=256)
    parser.add_argument("--rate", type=int, default=200, help="samples per second asked of py-spy")
    parser.add_argument("--top", type=int, default=25, help="rows per table")
    parser.add_argument("--out", type=Path, help="where the raw stacks go (default: a new dir)")
    parser.add_argument(
        "--arrivals",
        type=Path,
        help="write each request's send -> ready for the engine (ms, JSON) of the unprofiled "
        "run here, for arrival_delay.py --delays empirical:FILE",
    )
    args = parser.parse_args()
    spy = py_spy()
    console = Console(width=200)
    signal.signal(signal.SIGTERM, interrupt_on_signal)
    stamp = datetime.datetime.now(datetime.UTC).strftime("%Y%m%dT%H%M%S")
    out = args.out or Path(tempfile.gettempdir()) / f"lorafleet-profile-{stamp}"
    out.mkdir(parents=True, exist_ok=True)

    from transformers import AutoTokenizer

    scratch = Path(tempfile.mkdtemp(prefix="lorafleet-profile-"))
    try:
        specs = write_fixtures(scratch / "fixtures", adapters=ADAPTERS)
        model = scratch / "fixtures" / "base"
        adapters = {spec.name: scratch / "fixtures" / "adapters" / spec.name for spec in specs}
        names = sorted(adapters)
        tokenizer = AutoTokenizer.from_pretrained(model)
        prompts = exact_prompts(tokenizer, 2 * args.requests + 1, seed=7)
        console.print("starting the stack", markup=False)
        with lorafleet_stack(model, adapters, scratch / "stack") as server:
            asyncio.run(warm(server, names, prompts[-1], 600))
            cpu: dict[str, float] = {}
            for profiled in (False, True):
                offset = args.requests if profiled else 0
                work = tuple(
                    (names[i % len(names)], prompts[offset + i]) for i in range(args.requests)
                )
                label = f"{args.scenario} c={args.concurrency}"
                scenario = Scenario(
                    label, args.scenario == "stream", args.concurrency, work, NEW_TOKENS
                )
                spies = [
                    record(spy, server.pids[name], args.rate, out / f"{name}.txt")
                    for name in (SAMPLED if profiled else ())
                ]
                before = cpu_now(server)
                result = asyncio.run(run(server.url, server.headers, scenario, 600))
                after = cpu_now(server)
                for process in spies:
                    process.send_signal(signal.SIGINT)  # py-spy writes its file on SIGINT
                for process in spies:
                    process.wait(timeout=60)
                stats = summarise([result])
                used = {name: after[name] - before[name] for name in after}
                if not profiled:
                    cpu = used
                    assert server.redis_url is not None
                    shown, arrivals = timeline(result, server.redis_url)
                    console.print(shown)
                    if args.arrivals:
                        args.arrivals.write_text(
                            json.dumps(
                                {
                                    "scenario": label,
                                    "requests": args.requests,
                                    "ms": [a * 1000 for a in arrivals],
                                }
                            )
                        )
                console.print(
                    f"{'profiled' if profiled else 'unprofiled'} {label}: {stats.ok} ok, "
                    f"{stats.failed} failed, {result.elapsed_s:.2f} s; CPU s: "
                    + ", ".join(f"{k} {v:.2f}" for k, v in used.items() if v >= 0.05),
                    markup=False,
                )
    finally:
        shutil.rmtree(scratch, ignore_errors=True)
    for name in SAMPLED:
        if not (out / f"{name}.txt").exists():
            # py-spy attaches with ptrace: root, or kernel.yama.ptrace_scope 0 for one's own.
            raise SystemExit(f"py-spy recorded nothing for the {name}: may it attach (ptrace)?")
        console.print(table(name, out / f"{name}.txt", cpu.get(name, 0.0), args.top))
    console.print(f"raw stacks (collapsed, one per line) in {out}", markup=False)


if __name__ == "__main__":
    main()
