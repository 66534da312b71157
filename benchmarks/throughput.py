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

import httpx
import psutil
from rich.console import Console
from rich.table import Table

from contracts.queues import Tier
from lorafleet.client import JobsClient
from lorafleet.fixtures import write_fixtures
from lorafleet.settings import LocalSettings
from lorafleet.stack import CPU_ENGINE_DEFAULTS, LocalStack

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
ENGINE = {"max_loras": 4, "max_cpu_loras": 8, "max_lora_rank": 8}


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


async def pipeline(
    gateway_url: str,
    work: list[tuple[str, str]],
    sequential: list[tuple[str, str]],
    console: Console,
    pids: dict[str, int],
    repeats: int,
) -> tuple[float, int, list[float]]:
    sampling = {"max_tokens": NEW_TOKENS, "temperature": 0.0, "ignore_eos": True}
    async with httpx.AsyncClient(base_url=gateway_url, timeout=60) as http:
        client = JobsClient(http)
        for alias in sorted({alias for alias, _ in work}):  # warm: loads are not measured
            await client.run(alias, "warm up", {"max_tokens": 2})
        runs = []
        for rep in range(repeats):
            cpu_before = cpu_seconds(pids)
            start = time.perf_counter()
            accepted = await asyncio.gather(*(client.submit(a, p, sampling) for a, p in work))
            submitted = time.perf_counter() - start
            done = await asyncio.gather(*(client.wait(job.id, 600) for job in accepted))
            elapsed = time.perf_counter() - start
            cpu_after = cpu_seconds(pids)
            tokens = sum(job.result.usage.completion_tokens for job in done if job.result)
            runs.append((elapsed, tokens))
            console.print(
                f"pipeline run {rep + 1}/{repeats}: {len(work)} jobs accepted after "
                f"{submitted:.2f} s, done after {elapsed:.2f} s; CPU seconds meanwhile "
                f"(2 cores = {2 * elapsed:.1f} s): "
                + ", ".join(
                    f"{name} {cpu_after[name] - cpu_before[name]:.1f}"
                    for name in cpu_after
                    if cpu_after[name] - cpu_before[name] >= 0.05
                )
            )
        elapsed, tokens = min(runs)
        console.print(f"pipeline: {len(sequential)} sequential jobs")
        latencies = []
        for alias, prompt in sequential:
            begin = time.perf_counter()
            accepted_one = await client.submit(alias, prompt, {"max_tokens": 8, "ignore_eos": True})
            await client.wait(accepted_one.id, 60)
            latencies.append((time.perf_counter() - begin) * 1000)
    return elapsed, tokens, latencies


def offline(
    model: Path,
    adapters: dict[str, Path],
    work: list[tuple[str, str]],
    sequential: list[tuple[str, str]],
    console: Console,
    repeats: int,
) -> tuple[float, int, list[float]]:
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
    llm.generate(
        ["warm up"] * len(requests),
        SamplingParams(max_tokens=2),
        lora_request=list(requests.values()),
        use_tqdm=False,
    )
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
        console.print(f"offline run {rep + 1}/{repeats}: {len(work)} prompts in {elapsed:.2f} s")
    elapsed, tokens = min(runs)
    latencies = []
    short = SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True)
    for alias, prompt in sequential:
        begin = time.perf_counter()
        llm.generate([prompt], short, lora_request=requests[alias], use_tqdm=False)
        latencies.append((time.perf_counter() - begin) * 1000)
    return elapsed, tokens, latencies


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
            pids = {child.name: child.pid for child in stack.children}
            pids["client"] = os.getpid()
            piped = asyncio.run(
                pipeline(stack.gateway_url, work, sequential, console, pids, args.repeats)
            )

        for key, value in CPU_ENGINE_DEFAULTS.items():
            os.environ.setdefault(key, value)
        direct = offline(model, adapters, work, sequential, console, args.repeats)
    finally:
        shutil.rmtree(scratch, ignore_errors=True)

    table = Table(title=f"{args.jobs} jobs x {NEW_TOKENS} tokens over {args.adapters} adapters")
    for column in ("path", "seconds", "generated tok/s", "p50 single job ms"):
        table.add_column(column, justify="left" if column == "path" else "right")
    for name, (elapsed, tokens, latencies) in (("pipeline", piped), ("offline LLM", direct)):
        table.add_row(
            name,
            f"{elapsed:.2f}",
            f"{tokens / elapsed:,.0f}",
            f"{statistics.median(latencies):.1f}",
        )
    console.print(table)
    ratio = (piped[1] / piped[0]) / (direct[1] / direct[0])
    added = statistics.median(piped[2]) - statistics.median(direct[2])
    console.print(f"pipeline / offline throughput: {ratio:.2f}x (target >= 0.7x)")
    console.print(f"added latency of the queue path (p50, 8 tokens): {added:.1f} ms")


if __name__ == "__main__":
    main()
