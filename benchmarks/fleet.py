"""Fleet scale by SIMULATION: the real gateway, Redis and routing code, simulated workers.

Tens of GPU workers cannot run on this machine, so the workers here are a timing model of an
engine (``EngineModel``: S3 fetch, load into the engine's CPU cache, GPU-slot swap, prefill,
decode; ``max_loras`` GPU slots, an LRU CPU cache and disk cache). Everything else is real: a
Valkey server, two gateway processes (routing on and off) admitting every job over HTTP, the
admission script pushing each message onto the queue routing chose, and the simulated workers
announcing what they hold exactly as ``worker.runtime`` does and taking jobs from their own
queue and their pool's shared queue. This measures the routing policy and its plumbing at
fleet scale; it proves nothing about correctness (the integration tests do that, with real
vLLM workers: ``tests/integration/test_fleet_routing.py``).

    .venv/bin/python benchmarks/fleet.py [--workers 16 32 64] [--seconds 30] [--rate 3]

Per cell (distribution x fleet size x routing): open-loop Poisson arrivals at ``--rate`` jobs/s
per worker over ``--adapters`` adapters (Zipf s = 1.1, or uniform), every worker starting
empty. Reported: residency at arrival on the worker that took the job (in the engine, or at
least on its disk), S3 fetches per adapter, GPU-slot swaps per worker-minute, TTFT p50/p99
(admission to first token, simulated engine times included), and the busiest worker's share of
jobs. The CPU is shared (2 cores: the load generator and the simulated workers in this
process, the gateways, Redis); each cell prints the CPU each used.
"""

from __future__ import annotations

import argparse
import asyncio
import base64
import json
import random
import statistics
import time
import uuid
from collections import Counter, OrderedDict
from dataclasses import dataclass, field
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

import aiohttp
import psutil
from prometheus_client.parser import text_string_to_metric_families
from redis.asyncio import BlockingConnectionPool, Redis
from rich.console import Console
from rich.table import Table

from contracts import metrics as names
from contracts.keys import WORKER_QUEUES, WORKERS_INDEX, worker_key
from contracts.queues import Tier, queue_for
from contracts.registry import AdapterRecord, BaseModelRef
from contracts.routing import worker_queue
from lorafleet.registry import Registry
from lorafleet.settings import LocalSettings
from lorafleet.stack import LocalStack

BASE = BaseModelRef(id="sim-base", digest="sha256:" + "5" * 64)
TIER = Tier.COLD
ZIPF_S = 1.1
console = Console(width=220)


@dataclass(frozen=True)
class EngineModel:
    """Seconds and sizes of a simulated GPU worker (a 7B model, rank-16 adapters)."""

    fetch_s: float = 1.5  # S3 GET of the adapter
    load_s: float = 0.04  # disk -> engine CPU cache
    swap_s: float = 0.008  # CPU cache -> GPU slot
    prefill_s: float = 0.025
    step_s: float = 0.02  # one decode step
    tokens: int = 32
    max_loras: int = 4
    max_cpu_loras: int = 16
    disk_adapters: int = 64
    concurrency: int = 32


@dataclass
class Stats:
    arrivals: list[tuple[float, str]] = field(default_factory=list)  # (accepted, level)
    ttft: list[tuple[float, float]] = field(default_factory=list)  # (accepted, seconds)
    fetches: Counter[str] = field(default_factory=Counter)
    swaps: int = 0
    jobs: Counter[str] = field(default_factory=Counter)


class SimWorker:
    def __init__(self, index: int, redis: Redis, model: EngineModel, stats: Stats) -> None:
        self.worker_id = f"sim{index}:{index}:{uuid.uuid4().hex[:8]}"
        self.queue = worker_queue(self.worker_id)
        self._redis, self._model, self._stats = redis, model, stats
        self.disk: OrderedDict[str, None] = OrderedDict()
        self.cpu: OrderedDict[str, None] = OrderedDict()
        self.gpu: OrderedDict[str, int] = OrderedDict()  # digest -> jobs using the slot
        self.running = 0
        self._fetching: dict[str, asyncio.Future[None]] = {}
        self._slots = asyncio.Condition()
        self._room = asyncio.Event()
        self._room.set()
        self._changed = asyncio.Event()
        self._tasks: set[asyncio.Task[None]] = set()

    def level(self, digest: str) -> str:
        if digest in self.gpu or digest in self.cpu:
            return "engine"
        return "disk" if digest in self.disk else "remote"

    async def announce(self) -> None:
        adapters = dict.fromkeys(self.disk, "disk")
        adapters.update(dict.fromkeys([*self.cpu, *self.gpu], "engine"))
        record = {
            "worker_id": self.worker_id,
            "state": "serving",
            "queue": self.queue,
            "base_model": BASE.model_dump(),
            "queues": [queue_for(TIER, BASE.digest)],
            "concurrency": self._model.concurrency,
            "max_loras": self._model.max_loras,
            "jobs_running": self.running,
            "adapters": adapters,
            "seen_at": time.time(),
        }
        async with self._redis.pipeline(transaction=False) as pipe:
            pipe.set(worker_key(self.worker_id), json.dumps(record), ex=10)
            pipe.sadd(WORKERS_INDEX, self.worker_id)
            await pipe.execute()

    async def announcer(self) -> None:
        while True:
            try:
                await asyncio.wait_for(self._changed.wait(), 1.0)
                await asyncio.sleep(0.2)  # changes within 0.2 s make one announcement
            except TimeoutError:
                pass
            self._changed.clear()
            await self.announce()

    async def consumer(self) -> None:
        queues = [self.queue, queue_for(TIER, BASE.digest)]
        while True:
            await self._room.wait()
            popped = await self._redis.brpop(queues, timeout=1)  # type: ignore[arg-type]
            if popped is None:
                continue
            envelope = json.loads(popped[1])
            message = json.loads(base64.b64decode(envelope["body"]))[0][0]
            self.running += 1
            if self.running >= self._model.concurrency:
                self._room.clear()
            task = asyncio.create_task(self.run(message))
            self._tasks.add(task)
            task.add_done_callback(self._tasks.discard)

    async def _on_disk(self, digest: str) -> None:
        if digest in self.disk:
            self.disk.move_to_end(digest)
            return
        if digest not in self._fetching:
            self._fetching[digest] = asyncio.get_running_loop().create_future()
            self._stats.fetches[digest] += 1
            await asyncio.sleep(self._model.fetch_s)
            self.disk[digest] = None
            while len(self.disk) > self._model.disk_adapters:
                self.disk.popitem(last=False)
            self._changed.set()
            self._fetching.pop(digest).set_result(None)
        else:
            await self._fetching[digest]

    async def run(self, message: dict[str, Any]) -> None:
        digest, accepted = str(message["revision"]), float(message["accepted_at"])
        self._stats.arrivals.append((accepted, self.level(digest)))
        self._stats.jobs[self.worker_id] += 1
        try:
            await self._on_disk(digest)
            async with self._slots:
                while digest not in self.gpu and len(self.gpu) >= self._model.max_loras:
                    idle = next((d for d, users in self.gpu.items() if users == 0), None)
                    if idle is not None:
                        del self.gpu[idle]
                        break
                    await self._slots.wait()
                if digest not in self.gpu:
                    if digest not in self.cpu:
                        await asyncio.sleep(self._model.load_s)
                        self.cpu[digest] = None
                        while len(self.cpu) > self._model.max_cpu_loras:
                            self.cpu.popitem(last=False)
                    await asyncio.sleep(self._model.swap_s)
                    self._stats.swaps += 1
                    self.gpu[digest] = 0
                    self._changed.set()
                self.gpu[digest] += 1
                self.gpu.move_to_end(digest)
            await asyncio.sleep(self._model.prefill_s)
            self._stats.ttft.append((accepted, time.time() - accepted))
            await asyncio.sleep(self._model.step_s * self._model.tokens)
            async with self._slots:
                self.gpu[digest] -= 1
                self._slots.notify_all()
        finally:
            self.running -= 1
            self._room.set()

    async def stop(self) -> None:
        for task in list(self._tasks):
            task.cancel()
        await self._redis.delete(worker_key(self.worker_id))
        await self._redis.srem(WORKERS_INDEX, self.worker_id)


def register_adapters(stack: LocalStack, count: int) -> list[str]:
    registry = Registry(stack.redis())
    aliases = []
    for index in range(count):
        alias = f"sim-{index:03d}"
        registry.register(
            AdapterRecord(
                alias=alias,
                digest=f"sha256:{index + 1:064x}",
                base_model=BASE,
                rank=16,
                alpha=32,
                target_modules=("q_proj", "v_proj"),
                size_bytes=50_000_000,
                tier=TIER,
                created_at=datetime.now(tz=UTC),
            )
        )
        aliases.append(alias)
    return aliases


async def submit_load(
    url: str, key: str, aliases: list[str], weights: list[float], rate: float, seconds: float
) -> Counter[int]:
    """Poisson arrivals over ``seconds``; the HTTP statuses answered."""
    statuses: Counter[int] = Counter()
    rng = random.Random(7)
    pending: set[asyncio.Task[None]] = set()
    async with aiohttp.ClientSession(
        url, headers={"Authorization": f"Bearer {key}"}, connector=aiohttp.TCPConnector(limit=128)
    ) as http:

        async def post(alias: str) -> None:
            body = {"adapter": alias, "prompt": "x", "sampling": {"max_tokens": 1}}
            async with http.post("/v1/jobs", json=body) as response:
                statuses[response.status] += 1

        end = time.monotonic() + seconds
        next_at = time.monotonic()
        while next_at < end:
            await asyncio.sleep(max(0.0, next_at - time.monotonic()))
            (alias,) = rng.choices(aliases, weights)
            task = asyncio.create_task(post(alias))
            pending.add(task)
            task.add_done_callback(pending.discard)
            next_at += rng.expovariate(rate)
        await asyncio.gather(*pending)
    return statuses


def _loud(task: asyncio.Task[None]) -> None:
    """A simulated worker's loop that dies says so (it would skew the cell silently)."""
    if not task.cancelled() and task.exception() is not None:
        console.print(f"[red]simulated worker loop failed: {task.exception()!r}[/]")


async def decisions(url: str) -> Counter[str]:
    """The gateway's routing decisions so far, from its own metrics."""
    async with aiohttp.ClientSession(url) as http, http.get("/metrics") as response:
        text = await response.text()
    counted: Counter[str] = Counter()
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            if sample.name == f"{names.ROUTING_DECISIONS}_total" or (
                sample.name == names.ROUTING_DECISIONS
            ):
                counted[sample.labels["decision"]] += int(sample.value)
    return counted


def pct(values: list[float], q: int) -> float:
    return statistics.quantiles(values, n=100)[q - 1] if len(values) > 1 else float("nan")


async def cell(
    stack: LocalStack,
    url: str,
    aliases: list[str],
    distribution: str,
    workers: int,
    args: argparse.Namespace,
    processes: dict[str, psutil.Process],
) -> dict[str, Any]:
    redis = Redis.from_url(stack.redis_url, decode_responses=True)
    for key in (queue_for(TIER, BASE.digest), WORKERS_INDEX, WORKER_QUEUES):
        await redis.delete(key)
    # A pool per simulated worker, as each real worker has its own: a blocked BRPOP holds a
    # connection, and a shared pool would starve the announcers.
    pools = [
        Redis(
            connection_pool=BlockingConnectionPool.from_url(
                stack.redis_url, decode_responses=True, max_connections=4, timeout=30
            )
        )
        for _ in range(workers)
    ]
    stats = Stats()
    model = EngineModel()
    fleet = [SimWorker(i, pools[i], model, stats) for i in range(workers)]
    for worker in fleet:
        await worker.announce()
    tasks = [asyncio.create_task(w.consumer()) for w in fleet]
    tasks += [asyncio.create_task(w.announcer()) for w in fleet]
    for task in tasks:
        task.add_done_callback(_loud)
    await asyncio.sleep(1.0)  # the gateways' next read of the fleet sees every worker
    weights = (
        [1 / rank**ZIPF_S for rank in range(1, len(aliases) + 1)]
        if distribution == "zipf"
        else [1.0] * len(aliases)
    )
    decided_before = await decisions(url)
    cpu_before = {name: p.cpu_times() for name, p in processes.items()}
    started = time.time()
    statuses = await submit_load(
        url, stack.api_key, aliases, weights, args.rate * workers, args.seconds
    )
    await asyncio.sleep(model.prefill_s + model.fetch_s + 1.0)  # the last arrivals start
    cpu = {
        name: sum(p.cpu_times()[:2]) - sum(cpu_before[name][:2]) for name, p in processes.items()
    }
    decided = await decisions(url)
    decided.subtract(decided_before)
    for task in tasks:
        task.cancel()
    for worker in fleet:
        await worker.stop()
    stranded = int(await redis.llen(queue_for(TIER, BASE.digest)))  # type: ignore[misc]
    for worker in fleet:
        stranded += int(await redis.llen(worker.queue))  # type: ignore[misc]
        await redis.delete(worker.queue)
    for pool in pools:
        await pool.aclose()
    await redis.aclose()
    steady = started + args.seconds / 2  # the second half: caches past their first fill
    arrived = [level for at, level in stats.arrivals if at >= steady]
    ttft = [s for at, s in stats.ttft if at >= steady]
    held = [stats.fetches.get(f"sha256:{i + 1:064x}", 0) for i in range(len(aliases))]
    asked = [c for c in held if c]
    minutes = workers * (time.time() - started) / 60
    return {
        "jobs": sum(stats.jobs.values()),
        "stranded": stranded,
        "refused": sum(n for status, n in statuses.items() if status != 202),
        "engine_hit": sum(level == "engine" for level in arrived) / max(1, len(arrived)),
        "local_hit": sum(level != "remote" for level in arrived) / max(1, len(arrived)),
        "fetches_mean": statistics.mean(asked) if asked else 0.0,
        "fetches_max": max(held),
        "swaps_per_min": stats.swaps / minutes,
        "ttft_p50": pct(ttft, 50) * 1000,
        "ttft_p99": pct(ttft, 99) * 1000,
        "busiest": max(stats.jobs.values()) / max(1, sum(stats.jobs.values())),
        "cpu": cpu,
        "decisions": decided,
    }


async def main_async(args: argparse.Namespace) -> None:
    settings = LocalSettings(
        state_dir=Path(args.state), s3_bucket="lorafleet-sim", redis_url=None, s3_endpoint_url=None
    )
    stack = LocalStack(settings, Path(__file__).resolve().parent)  # no worker reads the model
    env = {
        "LORAFLEET_MAX_ADMITTED_COLD": "100000000",
        "LORAFLEET_TENANT_MAX_CONCURRENT": "100000000",
        "LORAFLEET_TENANT_RATE_PER_S": "100000",
        "LORAFLEET_TENANT_BURST": "100000",
        "LORAFLEET_JOB_TTL_S": "120",
        "LORAFLEET_JOB_DEADLINE_S": "60",  # the record must outlive the job (settings refuse)
        "LORAFLEET_METRICS_PUBLIC": "true",
    }
    try:
        stack.start_infra()
        aliases = register_adapters(stack, args.adapters)
        urls = {}
        for routing in ("off", "on"):
            stack.start_gateway({**env, "LORAFLEET_ROUTING": str(routing == "on").lower()})
            urls[routing] = stack.gateway_url
        gateways = [c for c in stack.children if c.name == "gateway"]
        processes = {
            "gateway off": psutil.Process(gateways[0].pid),
            "gateway on": psutil.Process(gateways[1].pid),
            "redis": psutil.Process(next(c for c in stack.children if c.name == "redis").pid),
            "this process": psutil.Process(),
        }
        table = Table(title="Fleet by simulation (real gateway, Redis, routing; simulated workers)")
        for column in (
            "adapters",
            "workers",
            "routing",
            "jobs",
            "in engine at arrival",
            "on worker at arrival",
            "S3 fetches/adapter (mean, max)",
            "slot swaps/worker-min",
            "TTFT p50 ms",
            "TTFT p99 ms",
            "busiest worker's share",
        ):
            table.add_column(column)
        for distribution in args.distributions:
            for workers in args.workers:
                for routing in ("off", "on"):
                    label = f"{distribution}, {workers} workers, routing {routing}"
                    console.print(f"[bold]{label}[/]: {args.seconds:g} s of arrivals ...")
                    result = await cell(
                        stack, urls[routing], aliases, distribution, workers, args, processes
                    )
                    console.print(
                        f"  {result['jobs']} jobs started ({result['refused']} refused, "
                        f"{result['stranded']} never taken); decisions "
                        f"{dict(result['decisions'])}; CPU s: "
                        + ", ".join(f"{name} {s:.1f}" for name, s in result["cpu"].items())
                    )
                    table.add_row(
                        distribution,
                        str(workers),
                        routing,
                        str(result["jobs"]),
                        f"{result['engine_hit']:.1%}",
                        f"{result['local_hit']:.1%}",
                        f"{result['fetches_mean']:.2f}, {result['fetches_max']}",
                        f"{result['swaps_per_min']:.1f}",
                        f"{result['ttft_p50']:.0f}",
                        f"{result['ttft_p99']:.0f}",
                        f"{result['busiest']:.1%} (1/N {1 / workers:.1%})",
                    )
        console.print(table)
        console.print(f"engine model: {EngineModel()}")
    finally:
        stack.stop()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--workers", type=int, nargs="+", default=[16, 32, 64])
    parser.add_argument("--distributions", nargs="+", default=["zipf", "uniform"])
    parser.add_argument("--adapters", type=int, default=256)
    parser.add_argument("--seconds", type=float, default=30.0)
    parser.add_argument("--rate", type=float, default=3.0, help="jobs/s per worker")
    parser.add_argument("--state", default="/tmp/lorafleet-fleet-sim")
    asyncio.run(main_async(parser.parse_args()))


if __name__ == "__main__":
    main()
