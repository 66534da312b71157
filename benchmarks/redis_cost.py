"""What one job costs Redis, end to end: commands and round trips on each side, per way in.

The local stack (private Valkey and S3, one hot adapter) runs with the gateway, the worker and
the webhook worker started as the Procfile says, except that each talks to Redis through
counting proxies of its own (``redis_proxy.Tap``): one for its ``LORAFLEET_REDIS_URL`` (the
service's own commands) and one for its ``LORAFLEET_BROKER_URL`` (Celery's kombu transport).
Every side is thus counted apart: round trips, top-level commands by name, script calls by
script. The gateway has no Celery producer: it is given its ``LORAFLEET_REDIS_URL`` tap as its
broker too, so it sees one Redis, as deployed by default, and its admission script pushes the
task messages (``gateway.queue.JobQueues.inline``); with ``--broker-apart`` it gets a broker
tap of its own and pipelines the messages there after the admission. The server's ``INFO
commandstats`` counts every command it ran, also those run inside Lua scripts; the taps see
only what clients sent, so inside scripts = commandstats minus the taps' top-level counts,
command by command (no ``MONITOR`` needed).

Each way a job comes in runs ``--jobs`` jobs at ``--concurrency`` clients (after one warm-up
wave, so scripts are loaded and connection pools grown): the jobs API (``POST /v1/jobs`` then
one long-poll ``GET /v1/jobs/{id}?wait_s=60``), ``POST /v1/completions`` unstreamed and
streamed (8 and 64 tokens: streamed text is written as it comes), a job with a webhook (the
webhook worker delivers it), and batches of ``--batch-size`` (created, polled every
``--batch-poll-s``, results read once). Background traffic (heartbeats, kombu's ``BRPOP``
timeouts, the sweeper, the reaper, the webhook dispatcher...) is measured first over an idle
window and subtracted at its per-second rate from every window, which ends ``--settle-s``
after the last answer (acks and bookkeeping that follow the answer are counted).

    .venv/bin/python benchmarks/redis_cost.py [--jobs 200] [--concurrency 16] [--json out.json]
    .venv/bin/python benchmarks/redis_cost.py --jobs 20 --batch-size 20 --idle-s 10 \
        --only "jobs API + long" --only batch                  # a quick check that it runs

Depends only on the gateway's HTTP API, on Redis, and on the local stack that starts the
Procfile's processes; so it measures the code before and after a change alike. Tenant limits
and the gateway's Redis bounds are raised for the run (they change no command, only refusals).
"""

from __future__ import annotations

import argparse
import asyncio
import hashlib
import importlib
import json
import shutil
import signal
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import aiohttp
import httpx
import psutil
from aiohttp import web
from redis import Redis
from redis_cost_load import Load, drive, ways
from redis_cost_tables import SIDES, compare_table, report
from redis_proxy import Counts, Taps, key_shape
from rich.console import Console

from contracts.queues import Tier
from lorafleet.fixtures import write_fixtures
from lorafleet.processes import Child, free_port, interrupt_on_signal, spawn, wait_until
from lorafleet.settings import LocalSettings
from lorafleet.stack import REPO_ROOT, LocalStack, procfile_commands

PROCFILE_ROLE = {"gateway": "web", "worker": "worker", "webhooks": "webhooks"}
CHANNELS = ("app", "kombu")  # LORAFLEET_REDIS_URL, LORAFLEET_BROKER_URL
TAPS = [f"{side}/{channel}" for side in SIDES for channel in CHANNELS]
NO_REFUSALS = {
    # A refused job (429, or 503 when a busy box makes admission outlast its bound) would
    # count half a job: limits and the bound are raised. No command changes with them.
    "LORAFLEET_TENANT_RATE_PER_S": "1000000",
    "LORAFLEET_TENANT_BURST": "1000000",
    "LORAFLEET_TENANT_MAX_CONCURRENT": "1000000",
    "LORAFLEET_REDIS_TIMEOUT_S": "30",
    "LORAFLEET_REQUEST_TIMEOUT_S": "60",
}
OURS = {"info"}  # what this script sends the server directly (not through a tap)


# -- naming scripts ----------------------------------------------------------------------------


class ScriptNames:
    """Names a script call by the project constant whose SHA-1 it is (every module of
    contracts/, gateway/ and worker/ holding Lua is imported, unless it needs the engine);
    a script it does not find is named by the shapes of the keys it is called with."""

    def __init__(self, root: Path) -> None:
        self.known: dict[str, str] = {}
        for path in sorted(
            p for d in ("contracts", "gateway", "worker") for p in (root / d).rglob("*.py")
        ):
            text = path.read_text()
            if "redis.call(" not in text or "vllm" in text or "torch" in text:
                continue
            module = ".".join(path.relative_to(root).with_suffix("").parts)
            try:
                values = vars(importlib.import_module(module))
            except Exception:  # a module that no longer imports alone: name by keys instead
                continue
            for attr, value in values.items():
                if isinstance(value, str) and "redis.call(" in value and attr.isupper():
                    self.known.setdefault(hashlib.sha1(value.encode()).hexdigest(), attr)

    def __call__(self, sha: str, keys: list[str]) -> str:
        if sha in self.known:
            return self.known[sha]
        shapes = list(dict.fromkeys(key_shape(key) for key in keys))
        return f"keys({','.join(shapes[:5])}{',...' if len(shapes) > 5 else ''})"


# -- measuring ---------------------------------------------------------------------------------


@dataclass
class Snapshot:
    at: float
    taps: dict[str, Counts]
    stats: dict[str, int]
    redis_cpu_s: float


class Meter:
    """Reads the taps, the server's commandstats and its process CPU time."""

    def __init__(self, taps: Taps, redis: Redis, redis_pid: int) -> None:
        self.taps = taps
        self.redis = redis
        self.process = psutil.Process(redis_pid)

    def snapshot(self) -> Snapshot:
        info: dict[str, Any] = self.redis.info("commandstats")  # type: ignore[assignment]
        stats = {
            name.removeprefix("cmdstat_"): int(value["calls"])
            for name, value in info.items()
            if name.removeprefix("cmdstat_") not in OURS
        }
        cpu = self.process.cpu_times()
        return Snapshot(time.monotonic(), self.taps.snapshot(), stats, cpu.user + cpu.system)


def minus(a: dict[str, float], b: dict[str, float], factor: float = 1.0) -> dict[str, float]:
    """``a - factor * b``, key by key."""
    return {k: a.get(k, 0) - factor * b.get(k, 0) for k in sorted(set(a) | set(b))}


@dataclass
class Window:
    """What happened between two snapshots."""

    seconds: float
    taps: dict[str, dict[str, Any]]
    stats: dict[str, float]
    redis_cpu_s: float

    @classmethod
    def between(cls, start: Snapshot, end: Snapshot) -> Window:
        taps = {name: end.taps[name].minus(start.taps[name]).as_json() for name in end.taps}
        return cls(
            end.at - start.at,
            taps,
            minus(end.stats, start.stats),  # type: ignore[arg-type]
            end.redis_cpu_s - start.redis_cpu_s,
        )

    def net_of(self, idle: Window) -> Window:
        """This window less the idle window's traffic at its rate over this window's length."""
        factor = self.seconds / idle.seconds
        taps = {}
        for name, tap in self.taps.items():
            base = idle.taps[name]
            taps[name] = {
                key: minus(value, base[key], factor)
                if isinstance(value, dict)
                else value - factor * base[key]
                for key, value in tap.items()
            }
        return Window(
            self.seconds,
            taps,
            minus(self.stats, idle.stats, factor),
            self.redis_cpu_s - factor * idle.redis_cpu_s,
        )


def per_unit(window: Window, units: float) -> dict[str, Any]:
    """Per job (or per second) figures of a window, by side and for the server."""
    sides: dict[str, Any] = {}
    top_level: dict[str, float] = {}
    for name, tap in window.taps.items():
        side, channel = name.split("/")
        figures = {
            key: {k: v / units for k, v in value.items()}
            if isinstance(value, dict)
            else value / units
            for key, value in tap.items()
        }
        sides.setdefault(side, {})[channel] = figures
        for command, calls in tap["commands"].items():
            top_level[command] = top_level.get(command, 0) + calls / units
    server = {k: v / units for k, v in window.stats.items()}
    inside = {k: v for k, v in minus(server, top_level).items() if abs(v) >= 0.005}
    return {
        "sides": sides,
        "top_level": {k: v for k, v in top_level.items() if abs(v) >= 0.005},
        "inside_scripts": inside,
        "server_commands": sum(server.values()),
        "top_level_commands": sum(top_level.values()),
        "inside_script_commands": sum(inside.values()),
        "redis_cpu_ms": window.redis_cpu_s * 1000 / units,
    }


# -- the stack ---------------------------------------------------------------------------------


def start_service(stack: LocalStack, side: str, env: dict[str, str]) -> Child:
    """Start one Procfile process with its own environment (stopped with the stack)."""
    argv = ["sh", "-c", "exec " + procfile_commands()[PROCFILE_ROLE[side]]]
    child = spawn(side, argv, env, stack.log_dir, REPO_ROOT)
    stack.children.append(child)
    return child


def start_services(
    stack: LocalStack, taps: Taps, children: list[Child], broker_apart: bool = False
) -> str:
    """Gateway, worker and webhook worker, each through its own taps (added to ``children``
    as they start); the gateway's URL once it and the worker serve. The gateway's broker is
    its own Redis tap (one Redis: the admission pushes the messages) unless ``broker_apart``."""
    port = free_port()
    for side in SIDES:
        env = {**stack.service_env(), **NO_REFUSALS}
        env["LORAFLEET_REDIS_URL"] = taps.url(f"{side}/app")
        apart = side != "gateway" or broker_apart
        env["LORAFLEET_BROKER_URL"] = taps.url(f"{side}/kombu" if apart else f"{side}/app")
        if side == "gateway":
            env |= {"PORT": str(port), "LORAFLEET_GATEWAY_HOST": "127.0.0.1"}
        children.append(start_service(stack, side, env))
    gateway_url = f"http://127.0.0.1:{port}"
    wait_until(
        lambda: httpx.get(f"{gateway_url}/readyz", timeout=2).status_code == 200,
        stack.settings.startup_timeout_s,
        "the gateway",
        children,
    )
    stack.wait_worker(children[1])
    return gateway_url


# -- main --------------------------------------------------------------------------------------


async def measure_all(
    args: argparse.Namespace,
    meter: Meter,
    gateway_url: str,
    api_key: str,
    model: str,
    console: Console,
) -> dict[str, Any]:
    receiver = web.Application()
    hook_port = free_port()
    connector = aiohttp.TCPConnector(limit=0)
    headers = {"Authorization": f"Bearer {api_key}"}
    timeout = aiohttp.ClientTimeout(total=600)
    async with aiohttp.ClientSession(
        gateway_url, headers=headers, connector=connector, timeout=timeout
    ) as session:
        load = Load(session, model, f"http://127.0.0.1:{hook_port}/hook")
        receiver.router.add_post("/hook", load.receive_hook)
        runner = web.AppRunner(receiver, access_log=None)
        await runner.setup()
        await web.TCPSite(runner, "127.0.0.1", hook_port).start()
        try:
            chosen = [
                way
                for way in ways(args.batch_size, args.batch_poll_s)
                if not args.only or any(part in way.name for part in args.only)
            ]
            for way in chosen:
                console.print(f"warm-up: {way.name}")
                await drive(load, way, max(args.concurrency, way.jobs_per_call), args.concurrency)
            await asyncio.sleep(args.settle_s)
            console.print(f"idle window: {args.idle_s:g} s")
            start = meter.snapshot()
            await asyncio.sleep(args.idle_s)
            idle = Window.between(start, meter.snapshot())
            results = []
            for way in chosen:
                jobs = max(way.jobs_per_call, args.jobs // way.jobs_per_call * way.jobs_per_call)
                console.print(f"measuring: {way.name} ({jobs} jobs)")
                start = meter.snapshot()
                began = time.monotonic()
                out = await drive(load, way, jobs, args.concurrency)
                took = time.monotonic() - began
                await asyncio.sleep(args.settle_s)
                window = Window.between(start, meter.snapshot()).net_of(idle)
                result = {
                    "path": way.name,
                    "jobs": jobs,
                    "ok": out.ok,
                    "failed": out.failed,
                    "notes": dict(out.notes),
                    "http_requests": out.http_requests,
                    "load_s": took,
                    "window_s": window.seconds,
                    "per_job": per_unit(window, jobs),
                }
                results.append(result)
                console.print(
                    f"  {out.ok}/{jobs} ok in {took:.1f} s ({jobs / took:.1f} jobs/s)"
                    + (f"; failures: {dict(out.notes)}" if out.failed else "")
                )
        finally:
            await runner.cleanup()
    return {
        "idle": {"seconds": idle.seconds, "per_second": per_unit(idle, idle.seconds)},
        "paths": results,
    }


def run(args: argparse.Namespace, console: Console) -> dict[str, Any]:
    """Start the stack behind the taps, measure every path, stop everything."""
    scratch = Path(tempfile.mkdtemp(prefix="lorafleet-redis-cost-"))
    try:
        specs = write_fixtures(scratch / "fixtures", adapters=1)
        model = specs[0].name
        # A private Redis and S3 whatever the environment says: commandstats must be ours.
        settings = LocalSettings(state_dir=scratch / "state", redis_url=None, s3_endpoint_url=None)
        with LocalStack(settings, scratch / "fixtures" / "base") as stack:
            stack.start_infra()
            stack.publisher().publish(scratch / "fixtures" / "adapters" / model, model, Tier.HOT)
            server = stack.redis().connection_pool.connection_kwargs
            redis_pid = next(child.pid for child in stack.children if child.name == "redis")
            names = ScriptNames(REPO_ROOT)
            with Taps(TAPS, (server["host"], server["port"]), names) as taps:
                children: list[Child] = []
                try:
                    console.print("starting gateway, worker and webhook worker behind their taps")
                    gateway_url = start_services(stack, taps, children, args.broker_apart)
                    meter = Meter(taps, stack.redis(), redis_pid)
                    measured = asyncio.run(
                        measure_all(args, meter, gateway_url, stack.api_key, model, console)
                    )
                finally:
                    for child in reversed(children):  # while the taps still carry their drain
                        child.stop(timeout_s=60)
                        stack.children.remove(child)
    finally:
        shutil.rmtree(scratch, ignore_errors=True)
    measured["config"] = {k: str(v) for k, v in vars(args).items()} | {
        "repo": str(REPO_ROOT),
        "scripts_named": sorted(set(names.known.values())),
    }
    return measured


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--jobs", type=int, default=200, help="jobs per path")
    parser.add_argument("--concurrency", type=int, default=16, help="jobs in flight")
    parser.add_argument("--batch-size", type=int, default=100, help="jobs per batch")
    parser.add_argument("--batch-poll-s", type=float, default=1.0, help="batch status polls")
    parser.add_argument("--idle-s", type=float, default=40.0, help="background window")
    parser.add_argument("--settle-s", type=float, default=3.0, help="counted after the last answer")
    parser.add_argument("--only", action="append", help="run only paths whose name has this")
    parser.add_argument(
        "--broker-apart",
        action="store_true",
        help="the gateway publishes to a broker URL of its own (not inside its admission)",
    )
    parser.add_argument("--json", type=Path, help="write every figure here")
    parser.add_argument("--from-json", type=Path, help="print the tables of an earlier run")
    parser.add_argument("--compare", type=Path, help="an earlier run's JSON: print before/after")
    args = parser.parse_args()
    console = Console(width=140)
    signal.signal(signal.SIGTERM, interrupt_on_signal)
    if args.from_json:
        measured = json.loads(args.from_json.read_text())
    else:
        try:
            measured = run(args, console)
        except KeyboardInterrupt:
            console.print("interrupted: every process this run started is stopped")
            raise SystemExit(130) from None
        if args.json:
            args.json.write_text(json.dumps(measured, indent=1) + "\n")
    report(console, measured)
    if args.compare:
        console.print(compare_table(json.loads(args.compare.read_text()), measured))
    if args.json and not args.from_json:
        console.print(f"written: {args.json}")


if __name__ == "__main__":
    main()
