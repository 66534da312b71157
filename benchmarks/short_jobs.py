"""The short-job ceiling: jobs of one generated token, where the control plane is all the work.

A GPU engine finishes hundreds of short jobs a second; whatever the pipeline spends per job
(admitting it, queueing it, starting it, storing its result) then sets the ceiling. Here
``--jobs`` one-token jobs over 8 adapters go through each path, side by side in one run,
interleaved per repeat (the box's speed drifts):

- **batch API**: one ``POST /v1/batches`` of every job, clock until the batch has ended;
- **completions**: ``POST /v1/completions`` per job, ``--concurrency`` at once (aiohttp);
- **offline**: vLLM's ``LLM.generate`` of the same prompts and adapters in one call, with
  the worker's engine settings, in this process beside the stack.

Reported per path: jobs/s and the ratio to offline, and CPU milliseconds per job of each
process. The worker's main process runs vLLM's own frontend (tokenizing, output processing)
as well as Celery's consumer and lorafleet's job handling; offline, that frontend runs in
this process, so ``worker - offline frontend`` is what serving through lorafleet's worker
adds per job. Of that, the worker's own handling is counted by the worker itself
(``lorafleet_job_cpu_seconds_total``: ``start``, task body to engine submission, and
``finish``, engine result to stored outcome, in the job's thread), and Celery's consumer
(receiving each message and acknowledging it) is the main thread's CPU. The gateway's is all
lorafleet's.

    .venv/bin/python benchmarks/short_jobs.py [--jobs 2000] [--concurrency 256] [--repeats 2]

CPU: client (this process, also the offline engine's frontend), gateway, worker (+ its engine
processes), Redis and the webhook worker share the machine's cores; every row says which
process used what.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import random
import shutil
import statistics
import tempfile
import time
import urllib.request
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import Any

import aiohttp
import psutil
from rich.console import Console
from rich.table import Table
from throughput import ENGINE, Offline, cpu_seconds, prompts

from contracts import metrics as names
from contracts.keys import worker_key
from contracts.queues import Tier
from lorafleet.client import auth_headers
from lorafleet.fixtures import write_fixtures
from lorafleet.settings import LocalSettings
from lorafleet.stack import CPU_ENGINE_DEFAULTS, LocalStack

ONE_TOKEN = {"max_tokens": 1, "temperature": 0.0, "ignore_eos": True}
# The benchmark measures the serving path, not a tenant's quota or a tier's size.
ADMISSION = {
    "LORAFLEET_TENANT_MAX_CONCURRENT": "1000000",
    "LORAFLEET_TENANT_RATE_PER_S": "1000000",
    "LORAFLEET_TENANT_BURST": "1000000",
    "LORAFLEET_MAX_ADMITTED_COLD": "1000000",
}
PATHS = ("batch API", "completions", "offline LLM.generate")


async def _ok(response: aiohttp.ClientResponse, expect: int) -> Any:
    body = await response.json(content_type=None)
    if response.status != expect:
        raise RuntimeError(f"{response.method} {response.url}: {response.status} {body}")
    return body


async def batch(http: aiohttp.ClientSession, work: list[tuple[str, str]]) -> None:
    """One batch of every job; returns once it ended with every job succeeded."""
    requests = [{"adapter": a, "prompt": p, "sampling": ONE_TOKEN} for a, p in work]
    async with http.post("/v1/batches", json={"requests": requests}) as response:
        batch_id = (await _ok(response, 202))["id"]
    while True:
        async with http.get(f"/v1/batches/{batch_id}") as response:
            state = await _ok(response, 200)
        if state["status"] not in ("validating", "in_progress"):
            break
        await asyncio.sleep(0.05)
    if state["counts"]["succeeded"] != len(work):
        raise RuntimeError(f"batch {batch_id} ended {state['status']}: {state['counts']}")


async def completions(
    http: aiohttp.ClientSession, work: list[tuple[str, str]], concurrency: int
) -> None:
    """A completion per job, ``concurrency`` at a time; every one must succeed."""
    gate = asyncio.Semaphore(concurrency)

    async def one(adapter: str, prompt: str) -> None:
        async with (
            gate,
            http.post(
                "/v1/completions", json={"model": adapter, "prompt": prompt, **ONE_TOKEN}
            ) as response,
        ):
            await _ok(response, 200)

    await asyncio.gather(*(one(a, p) for a, p in work))


Run = tuple[float, dict[str, float]]  # seconds, CPU seconds by process (and by phase)


def worker_cpu(pid: int, metrics_url: str) -> dict[str, float]:
    """CPU seconds so far of the worker's consumer (main) thread, and of its own job handling
    by phase (its ``lorafleet_job_cpu_seconds_total``)."""
    threads = {thread.id: thread for thread in psutil.Process(pid).threads()}
    used = {"consumer": threads[pid].user_time + threads[pid].system_time}
    text = urllib.request.urlopen(metrics_url, timeout=10).read().decode()
    for line in text.splitlines():
        if line.startswith(names.JOB_CPU + "{"):
            phase = line.split('phase="', 1)[1].split('"', 1)[0]
            used[f"job {phase}"] = float(line.rsplit(" ", 1)[1])
    return used


async def measure(
    go: Callable[[], Awaitable[object]],
    pids: dict[str, int],
    offline: set[int],
    metrics_url: str,
) -> Run:
    before = cpu_seconds(pids, offline) | worker_cpu(pids["worker"], metrics_url)
    start = time.perf_counter()
    await go()
    elapsed = time.perf_counter() - start
    after = cpu_seconds(pids, offline) | worker_cpu(pids["worker"], metrics_url)
    return elapsed, {name: after[name] - before.get(name, 0.0) for name in after}


async def drive(
    stack: LocalStack,
    work: list[tuple[str, str]],
    offline: Offline,
    concurrency: int,
    repeats: int,
    console: Console,
) -> dict[str, list[Run]]:
    pids = {child.name: child.pid for child in stack.children if child.name != "s3"}
    pids["client"] = os.getpid()
    worker = next(child for child in stack.children if child.name == "worker")
    announced = json.loads(str(stack.redis().get(worker_key(str(stack.worker_id(worker))))))
    metrics_url = f"http://127.0.0.1:{announced['metrics_port']}/metrics"
    connector = aiohttp.TCPConnector(limit=concurrency)
    timeout = aiohttp.ClientTimeout(total=1800)
    runs: dict[str, list[Run]] = {path: [] for path in PATHS}
    async with aiohttp.ClientSession(
        stack.gateway_url, headers=auth_headers(stack.api_key), connector=connector, timeout=timeout
    ) as http:
        warm = [(adapter, "warm up") for adapter in sorted({a for a, _ in work})]
        await completions(http, warm, concurrency)  # every adapter fetched and loaded once
        goes: dict[str, Callable[[], Awaitable[object]]] = {
            "batch API": lambda: batch(http, work),
            "completions": lambda: completions(http, work, concurrency),
            "offline LLM.generate": lambda: asyncio.to_thread(offline.run, work),
        }
        for repeat in range(repeats):
            for path in PATHS:
                run = await measure(goes[path], pids, offline.pids, metrics_url)
                runs[path].append(run)
                console.print(
                    f"{path} {repeat + 1}/{repeats}: {len(work) / run[0]:,.0f} jobs/s "
                    f"({run[0]:.1f} s)"
                )
    return runs


def report(runs: dict[str, list[Run]], jobs: int, console: Console) -> None:
    def rate(run: Run) -> float:
        return jobs / run[0]

    offline_best = max(rate(run) for run in runs["offline LLM.generate"])
    # The offline engine's frontend runs in this process: its CPU during the offline runs.
    frontend = statistics.median(
        run[1]["client"] * 1000 / jobs for run in runs["offline LLM.generate"]
    )
    table = Table(title=f"{jobs} jobs of 1 token over 8 adapters; CPU ms per job (median)")
    for column in (
        "path",
        "best jobs/s",
        "vs offline",
        "gateway",
        "worker",
        "worker - offline frontend",
        "of it: consumer",
        "job start",
        "job finish",
        "engine processes",
        "redis",
        "client",
    ):
        table.add_column(column, justify="left" if column == "path" else "right")
    for path, path_runs in runs.items():
        best = max(path_runs, key=rate)

        def cpu(name: str, path_runs: list[Run] = path_runs) -> float:
            return statistics.median(run[1].get(name, 0.0) * 1000 / jobs for run in path_runs)

        offline = path == "offline LLM.generate"
        engine = cpu("offline engine") if offline else cpu("worker+children")
        table.add_row(
            path,
            f"{rate(best):,.0f}",
            f"{rate(best) / offline_best:.2f}x",
            "-" if offline else f"{cpu('gateway'):.2f}",
            "-" if offline else f"{cpu('worker'):.2f}",
            "-" if offline else f"{cpu('worker') - frontend:.2f}",
            "-" if offline else f"{cpu('consumer'):.2f}",
            "-" if offline else f"{cpu('job start'):.2f}",
            "-" if offline else f"{cpu('job finish'):.2f}",
            f"{engine:.2f}",
            "-" if offline else f"{cpu('redis'):.2f}",
            f"{cpu('client'):.2f}",
        )
    console.print(table)
    console.print(
        f"offline frontend (this process during LLM.generate): {frontend:.2f} ms per job. "
        "Targets: pipeline >= 0.8x offline; the worker's own CPU per job start < 1 ms "
        "(job start), Celery's consumer apart."
    )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--jobs", type=int, default=2000)
    parser.add_argument("--adapters", type=int, default=8)
    parser.add_argument("--concurrency", type=int, default=256)
    parser.add_argument("--repeats", type=int, default=2)
    args = parser.parse_args()
    console = Console(width=160)
    scratch = Path(tempfile.mkdtemp(prefix="lorafleet-short-"))
    try:
        specs = write_fixtures(scratch / "fixtures", adapters=args.adapters)
        model = scratch / "fixtures" / "base"
        adapters = {spec.name: scratch / "fixtures" / "adapters" / spec.name for spec in specs}
        rng = random.Random(5)
        work = [(rng.choice(sorted(adapters)), text) for text in prompts(args.jobs)]
        with LocalStack(LocalSettings(state_dir=scratch / "state"), model) as stack:
            stack.start_infra()
            publisher = stack.publisher()
            for name, path in adapters.items():
                publisher.publish(path, name, Tier.COLD)
            console.print(f"starting gateway and worker (admission limits raised: {ADMISSION})")
            engine = {f"LORAFLEET_{k.upper()}": str(v) for k, v in ENGINE.items()}
            stack.start_services(engine | ADMISSION)
            console.print("starting the offline engine beside them")
            for key, value in CPU_ENGINE_DEFAULTS.items():
                os.environ.setdefault(key, value)
            offline = Offline(model, adapters, new_tokens=1)
            runs = asyncio.run(drive(stack, work, offline, args.concurrency, args.repeats, console))
    finally:
        shutil.rmtree(scratch, ignore_errors=True)
    report(runs, args.jobs, console)


if __name__ == "__main__":
    main()
