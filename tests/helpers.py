"""Helpers shared by test modules."""

from __future__ import annotations

import asyncio
import os
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import httpx
from celery import Celery

from contracts.jobs import JobPublic
from lorafleet.client import JobsClient
from lorafleet.stack import LocalStack


def processes_with_env(marker: str) -> list[int]:
    """Pids whose environment contains ``marker`` (the test's unique state dir)."""
    found = []
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit() or int(entry.name) == os.getpid():
            continue
        try:
            if marker.encode() in (entry / "environ").read_bytes():
                found.append(int(entry.name))
        except OSError:
            continue
    return found


def run_jobs(
    gateway_url: str, work: list[tuple[str, str]], sampling: dict[str, Any]
) -> list[JobPublic]:
    """Submit every (adapter, prompt) first, then wait for all: they run concurrently."""

    async def go() -> list[JobPublic]:
        async with httpx.AsyncClient(base_url=gateway_url, timeout=30) as http:
            client = JobsClient(http)
            accepted = [await client.submit(name, prompt, sampling) for name, prompt in work]
            return list(await asyncio.gather(*(client.wait(job.id, 300) for job in accepted)))

    return asyncio.run(go())


@contextmanager
def paused(stack: LocalStack, queue: str) -> Iterator[None]:
    """The stack's worker stops consuming ``queue`` (jobs stay in Redis) until exit."""
    control = Celery(broker=stack.redis_url).control
    replies = control.cancel_consumer(queue, reply=True, timeout=10)
    assert replies, "the worker did not answer cancel_consumer"
    try:
        yield
    finally:
        assert control.add_consumer(queue, reply=True, timeout=10)
