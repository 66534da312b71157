"""``lorafleet demo``: fixtures, a local stack, 12 published adapters and 200 skewed jobs."""

from __future__ import annotations

import asyncio
import json
import random
import shutil
import signal
import time
from pathlib import Path
from typing import Any

import httpx
from rich.console import Console
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TimeElapsedColumn

from contracts.jobs import JobPublic
from contracts.queues import Tier
from lorafleet.client import JobsClient, auth_headers
from lorafleet.fixtures import write_fixtures
from lorafleet.processes import interrupt_on_signal
from lorafleet.report import summarise, table
from lorafleet.settings import LocalSettings
from lorafleet.stack import LocalStack

TIERS = [Tier.HOT] * 2 + [Tier.WARM] * 4 + [Tier.COLD] * 6
PROMPTS = [
    "Extract the total amount and the due date:",
    "Summarise the conversation in one sentence.",
    "Translate the paragraph into French,",
    "Classify the sentiment of this review",
    "The engine loads hot adapters",
    "Queues fill and drain; workers scale",
]
HOT_SHARE = 0.8


def job_mix(aliases: list[str], count: int, seed: int = 7) -> list[tuple[str, str]]:
    """``count`` (alias, prompt) pairs: ``HOT_SHARE`` to the first alias, the rest spread."""
    rng = random.Random(seed)
    mix = []
    for index in range(count):
        alias = aliases[0] if rng.random() < HOT_SHARE else rng.choice(aliases[1:])
        mix.append((alias, PROMPTS[index % len(PROMPTS)]))
    return mix


def run_demo(settings: LocalSettings, jobs: int, report_path: Path, console: Console) -> int:
    """Run the whole demo; returns the exit code. Every process started is stopped."""
    # SIGTERM takes the same clean path as Ctrl-C.
    signal.signal(signal.SIGTERM, interrupt_on_signal)
    console.print("[bold]1/5[/] fixtures: tiny Llama base model + 12 LoRA adapters")
    specs = write_fixtures(settings.fixtures_dir, adapters=len(TIERS))
    model = (settings.model or settings.fixtures_dir / "base").resolve()

    with LocalStack(settings, model) as stack:
        console.print("[bold]2/5[/] local stack: Redis, S3")
        stack.start_infra()
        console.print(f"      redis {stack.redis_url}  s3 {stack.s3_endpoint_url}")

        console.print("[bold]3/5[/] publishing adapters: 2 hot, 4 warm, 6 cold")
        tiers: dict[str, str] = {}
        publisher = stack.publisher()
        for spec, tier in zip(specs, TIERS, strict=True):
            record = publisher.publish(
                settings.fixtures_dir / "adapters" / spec.name, spec.name, tier
            )
            tiers[record.alias] = record.tier.value

        console.print("      starting gateway and worker (the engine takes ~40 s on a CPU)")
        started = time.perf_counter()
        # A fresh disk cache each run, so the cold tier really starts in S3.
        shutil.rmtree(stack.state_dir / "cache", ignore_errors=True)
        stack.start_services()
        console.print(f"      ready in {time.perf_counter() - started:.0f} s: {stack.gateway_url}")

        console.print(f"[bold]4/5[/] submitting {jobs} jobs (80% to one hot adapter)")
        results = asyncio.run(_run_jobs(stack, job_mix(list(tiers), jobs), console))

    summary = summarise(results, tiers)
    console.print(table(summary))
    report = {
        "jobs": len(results),
        "tiers": summary,
        "results": [job.model_dump(mode="json", exclude={"result": {"text"}}) for job in results],
    }
    report_path.write_text(json.dumps(report, indent=2) + "\n")
    console.print(f"[bold]5/5[/] report written to {report_path}; every process stopped")
    mismatched = summary["all"]["identity_mismatched"]
    console.print(f"identity mismatches: {mismatched}")
    ok = summary["all"]["succeeded"] == len(results) and mismatched == 0
    return 0 if ok else 1


async def _run_jobs(
    stack: LocalStack, mix: list[tuple[str, str]], console: Console
) -> list[JobPublic]:
    limits = httpx.Limits(max_connections=64)
    async with httpx.AsyncClient(
        base_url=stack.gateway_url, headers=auth_headers(stack.api_key), timeout=30, limits=limits
    ) as http:
        client = JobsClient(http)
        sampling: dict[str, Any] = {"max_tokens": 32, "temperature": 0.0}
        with Progress(
            "[progress.description]{task.description}",
            BarColumn(),
            MofNCompleteColumn(),
            TimeElapsedColumn(),
            console=console,
        ) as progress:
            task = progress.add_task("jobs finished", total=len(mix))

            async def one(alias: str, prompt: str) -> JobPublic:
                job = await client.run(alias, prompt, sampling)
                progress.advance(task)
                return job

            return list(await asyncio.gather(*(one(alias, prompt) for alias, prompt in mix)))
