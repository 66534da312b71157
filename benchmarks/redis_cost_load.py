"""The ways a job comes in, as a caller of the gateway's HTTP API sends them (aiohttp).

Each way runs whole jobs and counts what came back: the jobs API with one long-poll, the same
with a webhook (waited for at a local receiver), completions unstreamed and streamed, batches
(created, polled, results read). ``redis_cost.py`` counts their Redis traffic.
"""

from __future__ import annotations

import asyncio
import json
from collections import Counter
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from typing import Any

import aiohttp
from aiohttp import web

PROMPT = "extract the total amount due"
TERMINAL = {"succeeded", "failed", "cancelled"}


@dataclass
class Outcome:
    ok: int = 0
    failed: int = 0
    http_requests: int = 0
    notes: Counter[str] = field(default_factory=Counter)


class Load:
    """The ways a job comes in, each as a coroutine running ``jobs`` jobs."""

    def __init__(self, session: aiohttp.ClientSession, model: str, hook_url: str) -> None:
        self.session = session
        self.model = model
        self.hook_url = hook_url
        self.hooks: dict[str, asyncio.Future[str]] = {}

    def sampling(self, tokens: int) -> dict[str, Any]:
        return {"max_tokens": tokens, "temperature": 0, "ignore_eos": True}

    async def jobs_api(self, out: Outcome, webhook: bool = False) -> None:
        body: dict[str, Any] = {
            "adapter": self.model,
            "prompt": PROMPT,
            "sampling": self.sampling(8),
        }
        if webhook:
            body["webhook"] = {"url": self.hook_url}
        async with self.session.post("/v1/jobs", json=body) as response:
            out.http_requests += 1
            if response.status != 202:
                out.failed += 1
                out.notes[f"POST {response.status}"] += 1
                return
            job_id = (await response.json())["id"]
        if webhook:
            delivered = self.hooks.setdefault(job_id, asyncio.get_running_loop().create_future())
            kind = await asyncio.wait_for(delivered, 120)
            self.hooks.pop(job_id, None)
            if kind == "job.succeeded":
                out.ok += 1
            else:
                out.failed += 1
                out.notes[kind] += 1
            return
        while True:
            async with self.session.get(f"/v1/jobs/{job_id}", params={"wait_s": "60"}) as response:
                out.http_requests += 1
                status = (await response.json())["status"]
            if status in TERMINAL:
                break
        if status == "succeeded":
            out.ok += 1
        else:
            out.failed += 1
            out.notes[status] += 1

    async def completion(self, out: Outcome, tokens: int, stream: bool) -> None:
        body = {"model": self.model, "prompt": PROMPT, "stream": stream, **self.sampling(tokens)}
        async with self.session.post("/v1/completions", json=body) as response:
            out.http_requests += 1
            if response.status != 200:
                out.failed += 1
                out.notes[f"POST {response.status}"] += 1
                return
            if not stream:
                await response.read()
                out.ok += 1
                return
            done = errors = 0
            async for raw in response.content:
                line = raw.decode().strip()
                if line == "data: [DONE]":
                    done += 1
                elif line.startswith("data: ") and '"error"' in line:
                    errors += 1
        if done and not errors:
            out.ok += 1
        else:
            out.failed += 1
            out.notes["stream error"] += 1

    async def batch(self, out: Outcome, size: int, poll_s: float) -> None:
        requests = [
            {
                "custom_id": f"r{n}",
                "adapter": self.model,
                "prompt": PROMPT,
                "sampling": self.sampling(8),
            }
            for n in range(size)
        ]
        async with self.session.post("/v1/batches", json={"requests": requests}) as response:
            out.http_requests += 1
            if response.status != 202:
                out.failed += size
                out.notes[f"POST {response.status}"] += 1
                return
            batch_id = (await response.json())["id"]
        while True:
            await asyncio.sleep(poll_s)
            async with self.session.get(f"/v1/batches/{batch_id}") as response:
                out.http_requests += 1
                if (await response.json())["status"] not in ("validating", "in_progress"):
                    break
        async with self.session.get(f"/v1/batches/{batch_id}/results") as response:
            out.http_requests += 1
            lines = [json.loads(line) for line in (await response.text()).splitlines() if line]
        ok = sum(line["status"] == "succeeded" for line in lines)
        out.ok += ok
        out.failed += size - ok

    async def receive_hook(self, request: web.Request) -> web.Response:
        job_id = request.headers.get("webhook-id", "").removeprefix("evt_job_")
        kind = str((await request.json()).get("type"))
        future = self.hooks.setdefault(job_id, asyncio.get_running_loop().create_future())
        if not future.done():
            future.set_result(kind)
        return web.Response(status=200)


@dataclass(frozen=True)
class Way:
    """One way a job comes in: ``call`` runs ``jobs_per_call`` jobs end to end."""

    name: str
    jobs_per_call: int
    call: Callable[[Load, Outcome], Awaitable[None]]


def ways(batch_size: int, batch_poll_s: float) -> list[Way]:
    return [
        Way("jobs API + long-poll", 1, lambda load, out: load.jobs_api(out)),
        Way("completions", 1, lambda load, out: load.completion(out, 8, stream=False)),
        Way("completions, streamed 8", 1, lambda load, out: load.completion(out, 8, stream=True)),
        Way("completions, streamed 64", 1, lambda load, out: load.completion(out, 64, True)),
        Way("jobs API + webhook", 1, lambda load, out: load.jobs_api(out, webhook=True)),
        Way(
            f"batch of {batch_size}",
            batch_size,
            lambda load, out: load.batch(out, batch_size, batch_poll_s),
        ),
    ]


async def drive(load: Load, way: Way, jobs: int, concurrency: int) -> Outcome:
    """Run ``jobs`` jobs the ``way`` they come in, ``concurrency`` jobs at a time."""
    out = Outcome()
    calls = max(1, jobs // way.jobs_per_call)
    gate = asyncio.Semaphore(max(1, concurrency // way.jobs_per_call))

    async def one() -> None:
        async with gate:
            try:
                await way.call(load, out)
            except (aiohttp.ClientError, TimeoutError) as exc:
                out.failed += way.jobs_per_call
                out.notes[type(exc).__name__] += 1

    await asyncio.gather(*(one() for _ in range(calls)))
    return out
