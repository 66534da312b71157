"""Pipeline throughput against vLLM's offline ``LLM.generate``, side by side in one run.

Pipeline: client -> gateway (HTTP) -> Redis -> Celery worker -> AsyncLLM, 256 jobs over 8
adapters, prompts of mixed length, 64 new tokens each (ignore_eos), as each kind of caller
sends them: OpenAI-style (a request per job, answered when done), the jobs API (submit, then
long-poll), the batch API (one request), and a batch queued while the worker was paused
(the worker alone, clock from its first job). Offline: the same prompts and adapters in one
``LLM.generate`` call with the same engine settings, in this process beside the stack. Each
repeat runs every path, offline last, so a box that speeds up or slows down moves all of
them; the table compares best with best and median with median. Then
the added latency of the queue path: p50 of 50 sequential single jobs, pipeline minus direct
engine. Every run prints where the CPU went (gateway, worker, engine core, client): on this
2-core box the gateway, Redis, the client and the worker's Python share the core the engine
leaves free.

    .venv/bin/python benchmarks/throughput.py [--jobs 256] [--adapters 8]
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import os
import random
import shutil
import statistics
import tempfile
import time
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import Any

import aiohttp
import psutil
from celery import Celery
from rich.console import Console
from rich.table import Table

from contracts.digests import manifest_of
from contracts.queues import Tier, queue_for
from lorafleet.client import auth_headers
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


def cpu_seconds(pids: dict[str, int], offline: set[int]) -> dict[str, float]:
    """CPU seconds used so far by each named process and, as ``<name>+children``, by its
    descendants (the worker's are its engine), and by the offline engine's processes (which
    should stay idle while the pipeline runs, and the pipeline's engine while offline runs)."""
    used = {}
    for name, pid in pids.items():
        root = psutil.Process(pid)
        times = root.cpu_times()
        used[name] = times.user + times.system
        if name == "client":  # the stack's processes are the client's children
            continue
        used[f"{name}+children"] = 0.0
        for proc in root.children(recursive=True):
            with contextlib.suppress(psutil.NoSuchProcess):
                times = proc.cpu_times()
                used[f"{name}+children"] += times.user + times.system
    used["offline engine"] = 0.0
    for pid in offline:
        with contextlib.suppress(psutil.NoSuchProcess):
            times = psutil.Process(pid).cpu_times()
            used["offline engine"] += times.user + times.system
    return used


Run = tuple[float, int]  # seconds, generated tokens
SAMPLING = {"max_tokens": NEW_TOKENS, "temperature": 0.0, "ignore_eos": True}


class Load:
    """The load generator, on aiohttp: it shares the two cores with the system under test,
    so it must cost little. 256 concurrent ``POST /v1/jobs`` cost this client 0.2 CPU s on
    aiohttp against 3.8 s on httpx (0.28, this box), which would be charged to the pipeline.
    vLLM's own serving benchmark uses aiohttp for the same reason."""

    def __init__(self, http: aiohttp.ClientSession) -> None:
        self._http = http

    retried = 0
    """Requests answered 503 or 429 and sent again after their ``Retry-After``, as a client
    should; a burst wider than the gateway can admit within its bound is shed this way."""

    async def _json(self, method: str, path: str, expect: int, **kw: Any) -> Any:
        for _ in range(10):
            async with self._http.request(method, path, **kw) as response:
                body = await response.json(content_type=None)
                if response.status in (429, 503):
                    Load.retried += 1
                    await asyncio.sleep(float(response.headers.get("Retry-After", "1")))
                    continue
                if response.status != expect:
                    raise RuntimeError(f"{method} {path}: {response.status} {body}")
                return body
        raise RuntimeError(f"{method} {path}: still refused after 10 attempts")

    async def submit(self, alias: str, prompt: str, sampling: dict[str, Any]) -> str:
        body = {"adapter": alias, "prompt": prompt, "sampling": sampling}
        return str((await self._json("POST", "/v1/jobs", 202, json=body))["id"])

    async def wait(self, job_id: str) -> int:
        """Long-poll the job until it ends; its generated tokens."""
        while True:
            job = await self._json("GET", f"/v1/jobs/{job_id}", 200, params={"wait_s": "20"})
            if job["status"] in ("succeeded", "failed", "cancelled"):
                if job["status"] != "succeeded":
                    raise RuntimeError(f"job {job_id} {job['status']}: {job.get('error')}")
                return int(job["result"]["usage"]["completion_tokens"])

    async def job(self, alias: str, prompt: str, sampling: dict[str, Any]) -> int:
        return await self.wait(await self.submit(alias, prompt, sampling))

    async def completion(self, alias: str, prompt: str) -> int:
        """``POST /v1/completions``: one request, answered when the job is done."""
        body = {"model": alias, "prompt": prompt, **SAMPLING}
        answer = await self._json("POST", "/v1/completions", 200, json=body)
        return int(answer["usage"]["completion_tokens"])

    async def create_batch(self, work: list[tuple[str, str]]) -> str:
        requests = [{"adapter": a, "prompt": p, "sampling": SAMPLING} for a, p in work]
        return str(
            (await self._json("POST", "/v1/batches", 202, json={"requests": requests}))["id"]
        )

    async def first_job(self, batch_id: str) -> str:
        """The id of the batch's first job (first queued, so first taken)."""
        async with self._http.get(f"/v1/batches/{batch_id}/results") as response:
            return str(json.loads((await response.text()).splitlines()[0])["job_id"])

    async def started(self, job_id: str) -> None:
        """Return once a worker has started ``job_id`` (polled every 5 ms)."""
        while (await self._json("GET", f"/v1/jobs/{job_id}", 200))["status"] == "queued":
            await asyncio.sleep(0.005)

    async def batch_tokens(self, batch_id: str) -> int:
        """Poll the batch every 0.1 s until it ends, then read its results."""
        while True:
            batch = await self._json("GET", f"/v1/batches/{batch_id}", 200)
            if batch["status"] not in ("validating", "in_progress"):
                break
            await asyncio.sleep(0.1)
        async with self._http.get(f"/v1/batches/{batch_id}/results") as response:
            lines = [json.loads(line) for line in (await response.text()).splitlines()]
        failed = [line for line in lines if line["status"] != "succeeded"]
        if failed:
            raise RuntimeError(f"{len(failed)} batch jobs did not succeed: {failed[0]}")
        return sum(int(line["result"]["usage"]["completion_tokens"]) for line in lines)


class Clock:
    """When a run's clock started; a path may start it later than its first request."""

    def __init__(self) -> None:
        self.start = time.perf_counter()

    def restart(self) -> None:
        self.start = time.perf_counter()


async def _measure(
    label: str,
    go: Callable[[Clock], Awaitable[int]],
    pids: dict[str, int],
    offline: set[int],
    console: Console,
) -> Run:
    Load.retried = 0
    cpu_before = cpu_seconds(pids, offline)
    clock = Clock()
    tokens = await go(clock)
    elapsed = time.perf_counter() - clock.start
    cpu_after = cpu_seconds(pids, offline)
    cpu = ", ".join(
        f"{name} {cpu_after[name] - cpu_before[name]:.1f}"
        for name in cpu_after
        if cpu_after[name] - cpu_before[name] >= 0.05
    )
    console.print(
        f"{label}: {tokens} tokens in {elapsed:.2f} s, {Load.retried} retried; CPU s: {cpu}"
    )
    return elapsed, tokens


PATHS = (  # how each kind of caller sends the 256 jobs (the module docstring says more)
    "OpenAI completions",
    "jobs API + long-poll",
    "batch API",
    "batch queued, worker alone",  # clock from the worker's first job
)


async def pipeline(
    stack: LocalStack,
    work: list[tuple[str, str]],
    sequential: list[tuple[str, str]],
    offline: Offline,
    console: Console,
    repeats: int,
) -> tuple[dict[str, list[Run]], list[float]]:
    """Every run of each path, offline's included (interleaved: each repeat runs every
    pipeline path, then offline, so a box that speeds up or slows down meanwhile moves both),
    and the latencies of sequential single jobs."""
    pids = {child.name: child.pid for child in stack.children if child.name != "s3"}
    pids["client"] = os.getpid()
    control = Celery(broker=stack.redis_url).control
    cold = queue_for(Tier.COLD, manifest_of(stack.model).digest())  # the adapters are cold
    connector = aiohttp.TCPConnector(limit=len(work))
    timeout = aiohttp.ClientTimeout(total=600)
    async with aiohttp.ClientSession(
        stack.gateway_url, headers=auth_headers(stack.api_key), connector=connector, timeout=timeout
    ) as http:
        load = Load(http)
        for alias in sorted({alias for alias, _ in work}):  # warm: loads are not measured
            await load.job(alias, "warm up", {"max_tokens": 2})

        async def completions(_: Clock) -> int:
            return sum(await asyncio.gather(*(load.completion(a, p) for a, p in work)))

        async def jobs(_: Clock) -> int:
            return sum(await asyncio.gather(*(load.job(a, p, SAMPLING) for a, p in work)))

        async def batch(_: Clock) -> int:
            return await load.batch_tokens(await load.create_batch(work))

        async def direct(_: Clock) -> int:
            return offline.run(work)

        runs: dict[str, list[Run]] = {path: [] for path in (*PATHS, OFFLINE)}
        for rep in range(repeats):
            for path, go in zip(
                (*PATHS, OFFLINE), (completions, jobs, batch, None, direct), strict=True
            ):
                if go is None:
                    # limit=1: return at the (single) worker's reply, not the timeout.
                    assert control.cancel_consumer(cold, reply=True, timeout=10, limit=1)
                    batch_id = await load.create_batch(work)
                    first = await load.first_job(batch_id)

                    async def resumed(
                        clock: Clock, batch_id: str = batch_id, first: str = first
                    ) -> int:
                        # The clock starts when the worker has started the first job: a
                        # consumer told to resume sees the queue only once its blocking
                        # receive (kombu's BRPOP, 1 s) returns, which steady work never waits.
                        assert control.add_consumer(cold, reply=True, timeout=10, limit=1)
                        await load.started(first)
                        clock.restart()
                        return await load.batch_tokens(batch_id)

                    go = resumed
                label = f"{path} {rep + 1}/{repeats}"
                run = await _measure(label, go, pids, offline.pids, console)
                runs[path].append(run)
        console.print(f"pipeline: {len(sequential)} sequential jobs")
        latencies = []
        for alias, prompt in sequential:
            begin = time.perf_counter()
            await load.job(alias, prompt, {"max_tokens": 8, "ignore_eos": True})
            latencies.append((time.perf_counter() - begin) * 1000)
    return runs, latencies


OFFLINE = "offline LLM.generate"


class Offline:
    """vLLM's offline ``LLM`` on the same model, adapters and engine settings, in this process
    beside the running stack (its engine waits idle while the pipeline runs: the runs print
    its CPU)."""

    def __init__(
        self, model: Path, adapters: dict[str, Path], new_tokens: int = NEW_TOKENS
    ) -> None:
        from vllm import LLM, SamplingParams
        from vllm.lora.request import LoRARequest

        before = {proc.pid for proc in psutil.Process().children(recursive=True)}
        self._llm = LLM(
            model=str(model),
            dtype="float32",
            enforce_eager=True,
            max_model_len=256,
            gpu_memory_utilization=0.3,
            enable_lora=True,
            **ENGINE,
        )
        self.pids = {proc.pid for proc in psutil.Process().children(recursive=True)} - before
        self._requests = {
            alias: LoRARequest(alias, index + 1, str(path))
            for index, (alias, path) in enumerate(sorted(adapters.items()))
        }
        self._params = SamplingParams(max_tokens=new_tokens, temperature=0.0, ignore_eos=True)
        self._short = SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True)
        self._llm.generate(
            ["warm up"] * len(self._requests),
            SamplingParams(max_tokens=2),
            lora_request=list(self._requests.values()),
            use_tqdm=False,
        )

    def run(self, work: list[tuple[str, str]]) -> int:
        """One ``generate`` call for all of ``work``; its generated tokens."""
        outputs = self._llm.generate(
            [p for _, p in work],
            self._params,
            lora_request=[self._requests[a] for a, _ in work],
            use_tqdm=False,
        )
        return sum(len(out.outputs[0].token_ids) for out in outputs)

    def latencies(self, sequential: list[tuple[str, str]]) -> list[float]:
        """Milliseconds of each single 8-token job, one after the other."""
        latencies = []
        for alias, prompt in sequential:
            begin = time.perf_counter()
            self._llm.generate(
                [prompt], self._short, lora_request=self._requests[alias], use_tqdm=False
            )
            latencies.append((time.perf_counter() - begin) * 1000)
        return latencies


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--jobs", type=int, default=256)
    parser.add_argument("--adapters", type=int, default=8)
    parser.add_argument("--sequential", type=int, default=50)
    parser.add_argument(
        "--repeats", type=int, default=3, help="runs of each path (best and median compared)"
    )
    args = parser.parse_args()
    console = Console(width=150)  # the table stays readable in a log file
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
            console.print("starting the offline engine beside them")
            for key, value in CPU_ENGINE_DEFAULTS.items():
                os.environ.setdefault(key, value)
            offline = Offline(model, adapters)
            runs, piped_latencies = asyncio.run(
                pipeline(stack, work, sequential, offline, console, args.repeats)
            )
            direct_latencies = offline.latencies(sequential)
    finally:
        shutil.rmtree(scratch, ignore_errors=True)

    def rate(run: Run) -> float:
        return run[1] / run[0]

    def median_rate(runs: list[Run]) -> float:
        return statistics.median(rate(run) for run in runs)

    # The pipeline's best against offline's best, and median against median: on a shared
    # box the two disagree, and both are worth seeing.
    offline_best = max(map(rate, runs[OFFLINE]))
    offline_median = median_rate(runs[OFFLINE])
    table = Table(
        title=f"{args.jobs} jobs x {NEW_TOKENS} tokens over {args.adapters} adapters, "
        f"{args.repeats} interleaved runs each; ratios vs {OFFLINE}"
    )
    for column in (
        "path",
        "best s",
        "best tok/s",
        "best vs best",
        "median tok/s",
        "median vs median",
    ):
        table.add_column(column, justify="left" if column == "path" else "right")
    for name, path_runs in runs.items():
        fastest = max(path_runs, key=rate)
        table.add_row(
            name if name == OFFLINE else f"pipeline: {name}",
            f"{fastest[0]:.2f}",
            f"{rate(fastest):,.0f}",
            f"{rate(fastest) / offline_best:.2f}x",
            f"{median_rate(path_runs):,.0f}",
            f"{median_rate(path_runs) / offline_median:.2f}x",
        )
    console.print(table)
    piped_p50 = statistics.median(piped_latencies)
    direct_p50 = statistics.median(direct_latencies)
    console.print(
        f"single job, 8 tokens, p50 of {len(piped_latencies)}: pipeline {piped_p50:.1f} ms, "
        f"direct engine {direct_p50:.1f} ms; added by the queue path: "
        f"{piped_p50 - direct_p50:.1f} ms"
    )
    console.print(
        "targets: per-request completions and the jobs API >= 0.9x offline, the batch API >= 0.95x"
    )


if __name__ == "__main__":
    main()
