"""Pipeline throughput against vLLM's offline ``LLM.generate``, side by side in one run.

Pipeline: client -> gateway (HTTP) -> Redis -> Celery worker -> AsyncLLM, 256 jobs over 8
adapters, prompts of mixed length, 64 new tokens each (ignore_eos). Offline: the same prompts
and adapters in one ``LLM.generate`` call with the same engine settings. Each path runs
``--repeats`` times and its fastest run is compared (this box is shared and noisy). Then the
added latency of the queue path: p50 of 50 sequential single jobs, pipeline minus direct engine.
The pipeline runs also print where the CPU went (gateway, worker, engine core, client).

    .venv/bin/python benchmarks/throughput.py [--jobs 256] [--adapters 8]
"""

from __future__ import annotations

import argparse
import asyncio
import os
import random
import shutil
import statistics
import tempfile
import time
from pathlib import Path
from typing import Any

import httpx
import psutil
from celery import Celery
from rich.console import Console
from rich.table import Table

from contracts.queues import Tier, queue_for
from lorafleet.client import JobsClient, auth_headers
from lorafleet.fixtures import write_fixtures
from lorafleet.settings import LocalSettings
from lorafleet.stack import CPU_ENGINE_DEFAULTS, LocalStack
from worker.engine import colocate_children

WORDS = [
    "extract",
    "the",
    "total",
    "amount",
    "due",
    "date",
    "vendor",
    "summarise",
    "translate",
    "classify",
    "review",
]
NEW_TOKENS = 64
QUEUE = queue_for(Tier.COLD)  # the adapters are published cold
# Both paths get these explicitly: left unset, vLLM picks different batch limits for its
# offline ``LLM`` class (CPU: 256 sequences, 4,096 tokens a step) than for a server (128, 2,048).
ENGINE = {
    "max_loras": 4,
    "max_cpu_loras": 8,
    "max_lora_rank": 8,
    "max_num_seqs": 256,
    "max_num_batched_tokens": 4096,
}


def prompts(count: int, seed: int = 3) -> list[str]:
    rng = random.Random(seed)
    return [" ".join(rng.choices(WORDS, k=rng.randint(3, 40))) for _ in range(count)]


def cpu_seconds(pids: dict[str, int]) -> dict[str, float]:
    """CPU seconds used so far by each named process and, as ``<name>+children``, by its
    descendants (the worker's are the engine core)."""
    used = {}
    for name, pid in pids.items():
        root = psutil.Process(pid)
        times = root.cpu_times()
        used[name] = times.user + times.system
        if name == "client":  # the stack's processes are the client's children
            continue
        used[f"{name}+children"] = 0.0
        for proc in root.children(recursive=True):
            try:
                times = proc.cpu_times()
            except psutil.NoSuchProcess:
                continue
            used[f"{name}+children"] += times.user + times.system
    return used


Run = tuple[float, int]  # seconds, generated tokens


async def _batch(
    client: JobsClient,
    work: list[tuple[str, str]],
    pids: dict[str, int],
    control: Any | None,
) -> tuple[Run, str]:
    """Submit ``work`` and wait for all of it; with ``control``, the worker's queue is paused
    during submission and the clock starts when it resumes (a queue already full)."""
    sampling = {"max_tokens": NEW_TOKENS, "temperature": 0.0, "ignore_eos": True}
    # limit=1: return at the (single) worker's reply instead of waiting out the timeout.
    if control is not None:
        assert control.cancel_consumer(QUEUE, reply=True, timeout=10, limit=1)
    start = time.perf_counter()
    accepted = await asyncio.gather(*(client.submit(a, p, sampling) for a, p in work))
    submitted = time.perf_counter() - start
    if control is not None:
        start = time.perf_counter()
        assert control.add_consumer(QUEUE, reply=True, timeout=10, limit=1)
    cpu_before = cpu_seconds(pids)
    done = await asyncio.gather(*(client.wait(job.id, 600) for job in accepted))
    elapsed = time.perf_counter() - start
    cpu_after = cpu_seconds(pids)
    tokens = sum(job.result.usage.completion_tokens for job in done if job.result)
    cpu = ", ".join(
        f"{name} {cpu_after[name] - cpu_before[name]:.1f}"
        for name in cpu_after
        if cpu_after[name] - cpu_before[name] >= 0.05
    )
    how = "queued first" if control else f"all accepted after {submitted:.2f} s"
    return (elapsed, tokens), f"{how}, done after {elapsed:.2f} s; CPU s meanwhile: {cpu}"


async def pipeline(
    stack: LocalStack,
    work: list[tuple[str, str]],
    sequential: list[tuple[str, str]],
    console: Console,
    repeats: int,
) -> tuple[Run, Run, list[float]]:
    """Best live run (submitted while the worker consumes), best queued run, and the
    latencies of sequential single jobs."""
    pids = {child.name: child.pid for child in stack.children if child.name != "s3"}
    pids["client"] = os.getpid()
    control = Celery(broker=stack.redis_url).control
    headers = auth_headers(stack.api_key)
    async with httpx.AsyncClient(base_url=stack.gateway_url, headers=headers, timeout=60) as http:
        client = JobsClient(http)
        for alias in sorted({alias for alias, _ in work}):  # warm: loads are not measured
            await client.run(alias, "warm up", {"max_tokens": 2})
        live: list[Run] = []
        queued: list[Run] = []
        for rep in range(repeats):
            for runs, mode in ((live, None), (queued, control)):
                run, line = await _batch(client, work, pids, mode)
                runs.append(run)
                name = "queued" if mode else "live"
                console.print(f"pipeline {name} {rep + 1}/{repeats}: {line}")
        console.print(f"pipeline: {len(sequential)} sequential jobs")
        latencies = []
        for alias, prompt in sequential:
            begin = time.perf_counter()
            accepted_one = await client.submit(alias, prompt, {"max_tokens": 8, "ignore_eos": True})
            await client.wait(accepted_one.id, 60)
            latencies.append((time.perf_counter() - begin) * 1000)
    return min(live), min(queued), latencies


def offline(
    model: Path,
    adapters: dict[str, Path],
    work: list[tuple[str, str]],
    sequential: list[tuple[str, str]],
    console: Console,
    repeats: int,
) -> dict[str, tuple[Run, list[float]]]:
    """Best run and single-job latencies of the engine alone, with vLLM's own CPU placement
    and then with the worker's (engine core colocated with the model worker); the pipeline is
    compared with the faster of the two."""
    from vllm import LLM, SamplingParams
    from vllm.lora.request import LoRARequest

    llm = LLM(
        model=str(model),
        dtype="float32",
        enforce_eager=True,
        max_model_len=256,
        gpu_memory_utilization=0.3,
        enable_lora=True,
        **ENGINE,
    )
    requests = {
        alias: LoRARequest(alias, index + 1, str(path))
        for index, (alias, path) in enumerate(sorted(adapters.items()))
    }
    params = SamplingParams(max_tokens=NEW_TOKENS, temperature=0.0, ignore_eos=True)
    short = SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True)
    llm.generate(
        ["warm up"] * len(requests),
        SamplingParams(max_tokens=2),
        lora_request=list(requests.values()),
        use_tqdm=False,
    )
    results = {}
    for placement in ("vLLM default", "colocated"):
        if placement == "colocated":
            cores = colocate_children(psutil.Process())
            console.print(f"offline: engine processes now bound to cores {cores}")
        runs = []
        for rep in range(repeats):
            start = time.perf_counter()
            outputs = llm.generate(
                [p for _, p in work],
                params,
                lora_request=[requests[a] for a, _ in work],
                use_tqdm=False,
            )
            elapsed = time.perf_counter() - start
            runs.append((elapsed, sum(len(out.outputs[0].token_ids) for out in outputs)))
            console.print(
                f"offline ({placement}) {rep + 1}/{repeats}: {len(work)} prompts in {elapsed:.2f} s"
            )
        latencies = []
        for alias, prompt in sequential:
            begin = time.perf_counter()
            llm.generate([prompt], short, lora_request=requests[alias], use_tqdm=False)
            latencies.append((time.perf_counter() - begin) * 1000)
        results[placement] = (min(runs), latencies)
    return results


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--jobs", type=int, default=256)
    parser.add_argument("--adapters", type=int, default=8)
    parser.add_argument("--sequential", type=int, default=50)
    parser.add_argument(
        "--repeats", type=int, default=3, help="runs of each path; the fastest is compared"
    )
    args = parser.parse_args()
    console = Console()
    scratch = Path(tempfile.mkdtemp(prefix="lorafleet-bench-"))
    try:
        specs = write_fixtures(scratch / "fixtures", adapters=args.adapters)
        model = scratch / "fixtures" / "base"
        adapters = {spec.name: scratch / "fixtures" / "adapters" / spec.name for spec in specs}
        texts = prompts(args.jobs)
        rng = random.Random(5)
        work = [(rng.choice(sorted(adapters)), text) for text in texts]
        sequential = [(specs[0].name, text) for text in prompts(args.sequential, seed=9)]

        settings = LocalSettings(state_dir=scratch / "state")
        with LocalStack(settings, model) as stack:
            stack.start_infra()
            publisher = stack.publisher()
            for name, path in adapters.items():
                publisher.publish(path, name, Tier.COLD)
            console.print("starting gateway and worker")
            stack.start_services({f"LORAFLEET_{k.upper()}": str(v) for k, v in ENGINE.items()})
            live, queued, piped_latencies = asyncio.run(
                pipeline(stack, work, sequential, console, args.repeats)
            )

        for key, value in CPU_ENGINE_DEFAULTS.items():
            os.environ.setdefault(key, value)
        direct = offline(model, adapters, work, sequential, console, args.repeats)
    finally:
        shutil.rmtree(scratch, ignore_errors=True)

    best = min(direct, key=lambda placement: direct[placement][0][0])
    offline_run, direct_latencies = direct[best]
    rates = {
        "pipeline, live (HTTP admission on the same 2 cores)": live,
        "pipeline, queue full (worker throughput)": queued,
        **{f"offline LLM.generate, {name}": run for name, (run, _) in direct.items()},
    }
    table = Table(title=f"{args.jobs} jobs x {NEW_TOKENS} tokens over {args.adapters} adapters")
    for column in ("path", "seconds", "generated tok/s", f"vs offline ({best})"):
        table.add_column(column, justify="left" if column == "path" else "right")
    offline_rate = offline_run[1] / offline_run[0]
    for name, (elapsed, tokens) in rates.items():
        rate = tokens / elapsed
        table.add_row(name, f"{elapsed:.2f}", f"{rate:,.0f}", f"{rate / offline_rate:.2f}x")
    console.print(table)
    piped_p50 = statistics.median(piped_latencies)
    direct_p50 = statistics.median(direct_latencies)
    console.print(
        f"single job, 8 tokens, p50 of {len(piped_latencies)}: pipeline {piped_p50:.1f} ms, "
        f"direct engine ({best}) {direct_p50:.1f} ms; added by the queue path: "
        f"{piped_p50 - direct_p50:.1f} ms"
    )
    console.print("target: pipeline >= 0.7x offline")


if __name__ == "__main__":
    main()
