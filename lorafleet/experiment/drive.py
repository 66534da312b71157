"""The open-loop generator: sends each planned request at its arrival time, whatever the
answers before it are doing, as a streamed ``POST /v1/completions``.

It never waits for an answer to send the next request. A request that finds the generator's
concurrency limit reached is dropped and counted; one sent later than its arrival time by more
than ``LATE_S`` is counted as delayed. Time to first token is measured here, from the send to
the first text chunk; which revision ran, and where its adapter was before, come from the
worker's metadata in the stream's last chunk, never from the output text.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from typing import Any

import httpx

from lorafleet.experiment.results import ProfileName, RequestRecord, Sample, Trial, mismatched
from lorafleet.experiment.traffic import Planned

LATE_S = 0.05
SAMPLE_EVERY_S = 0.5
LOAD_FAILURES = {"adapter_integrity", "adapter_unavailable", "adapter_load_failed"}


@dataclass(frozen=True)
class TrialContext:
    cell: str
    trial: Trial
    profile: ProfileName
    repetition: int
    offered_rate: float


@dataclass
class Driven:
    records: list[RequestRecord]
    duration_s: float
    queue_depth: list[Sample]
    worker_rss_mb: list[Sample]
    gpu_memory_mb: list[Sample] | None = None
    prefetches: dict[str, float] = field(default_factory=dict)


PREFETCH_PROBE = "prefetches:"
"""Probes named ``prefetches:<outcome>`` read a cumulative count of the worker's prefetches
with that outcome: the trial's own are the last sample less the first."""

Probe = Callable[[], Awaitable[float | None]]


async def _sample(
    probes: dict[str, Probe], out: dict[str, list[Sample]], started: float, stop: asyncio.Event
) -> None:
    while not stop.is_set():
        for name, probe in probes.items():
            try:
                value = await probe()
            except Exception:  # a probe that cannot read leaves a gap, not a failed trial
                value = None
            if value is not None:
                out[name].append(Sample(t=round(time.monotonic() - started, 3), value=value))
        with contextlib.suppress(TimeoutError):
            await asyncio.wait_for(stop.wait(), SAMPLE_EVERY_S)


def _error_code(body: bytes) -> str | None:
    try:
        return str(json.loads(body)["error"]["code"])
    except (ValueError, KeyError, TypeError):
        return None


async def _one(
    http: httpx.AsyncClient,
    planned: Planned,
    prompt: str,
    record: dict[str, Any],
    timeout_s: float,
) -> None:
    """Send one request and fill ``record`` (outcome, timings, identity) from its answer."""
    body = {
        "model": planned.adapter,
        "prompt": prompt,
        "max_tokens": planned.max_tokens,
        "temperature": 0.0,
        "ignore_eos": True,
        "stream": True,
        "stream_options": {"include_usage": True},
    }
    sent = time.monotonic()
    info: dict[str, Any] | None = None
    done = False
    try:
        async with asyncio.timeout(timeout_s):
            async with http.stream("POST", "/v1/completions", json=body) as response:
                record["job_id"] = response.headers.get("x-lorafleet-job-id")
                if response.status_code != 200:
                    code = _error_code(await response.aread())
                    record["code"] = code or f"http_{response.status_code}"
                    record["outcome"] = "refused"
                    return
                async for line in response.aiter_lines():
                    if not line.startswith("data: "):
                        continue
                    data = line[len("data: ") :]
                    if data == "[DONE]":
                        done = True
                        break
                    event = json.loads(data)
                    if "error" in event:
                        error = event["error"]
                        record["code"] = str(
                            error.get("code") if isinstance(error, dict) else error
                        )
                        record["outcome"] = (
                            "cancelled" if record["code"] == "cancelled" else "failed"
                        )
                        return
                    for choice in event.get("choices", []):
                        if choice.get("text") and record["ttft_ms"] is None:
                            record["ttft_ms"] = round((time.monotonic() - sent) * 1000, 3)
                    if "lorafleet" in event:
                        info = event["lorafleet"]
                    if event.get("usage"):
                        record["completion_tokens"] = event["usage"].get("completion_tokens")
    except (TimeoutError, httpx.TimeoutException):
        record["outcome"], record["code"] = "timeout", "timeout"
        return
    except httpx.HTTPError as exc:
        record["outcome"], record["code"] = "failed", f"transport:{type(exc).__name__}"
        return
    except Exception as exc:  # an answer this client cannot read: recorded, never raised
        record["outcome"], record["code"] = "failed", f"client:{type(exc).__name__}"
        return
    finally:
        record["e2e_ms"] = round((time.monotonic() - sent) * 1000, 3)
    if not done or info is None:
        # The stream ended without its last chunk or [DONE]: the job's end was not seen.
        record["outcome"], record["code"] = "failed", "stream_truncated"
        return
    record["outcome"], record["code"] = "completed", None
    _identity(record, info)


def _identity(record: dict[str, Any], info: dict[str, Any] | None) -> None:
    """A completed answer counts only if the worker says it ran the expected revision from
    verified files; an answer without that evidence is a mismatch, not a pass."""
    metadata = (info or {}).get("metadata") or {}
    # The revision the worker says it ran; the gateway's label must agree with it.
    record["revision"] = metadata.get("revision")
    record["loaded_digest"] = metadata.get("loaded_digest")
    record["identity_verified"] = metadata.get("identity_verified")
    record["residency_before"] = metadata.get("residency_before")
    record["prefetched"] = metadata.get("prefetched")
    record["load_ms"] = metadata.get("load_ms") or {}
    record["queue_wait_ms"] = metadata.get("queue_wait_ms")
    labelled = (info or {}).get("revision")
    record["identity_mismatch"] = labelled != record["expected_revision"] or mismatched(
        RequestRecord.model_validate(record)
    )


async def drive(
    gateway_url: str,
    api_key: str,
    context: TrialContext,
    requests: list[Planned],
    prompts: dict[tuple[int, int], str],
    expected: dict[str, str],
    concurrency_limit: int,
    timeout_s: float,
    probes: dict[str, Probe] | None = None,
    on_handled: Callable[[], None] | None = None,
) -> Driven:
    """Run one trial's sequence open loop; every planned request gets exactly one record."""
    records: list[dict[str, Any]] = []
    tasks: set[asyncio.Task[None]] = set()
    samples: dict[str, list[Sample]] = {name: [] for name in probes or {}}
    limits = httpx.Limits(max_connections=concurrency_limit, max_keepalive_connections=64)
    headers = {"Authorization": f"Bearer {api_key}"}
    async with httpx.AsyncClient(
        base_url=gateway_url, headers=headers, limits=limits, timeout=timeout_s
    ) as http:
        stop = asyncio.Event()
        started = time.monotonic()
        sampler = asyncio.create_task(_sample(probes or {}, samples, started, stop))
        try:
            for planned in requests:
                delay = started + planned.arrival_s - time.monotonic()
                if delay > 0:
                    await asyncio.sleep(delay)
                record = {
                    "cell": context.cell,
                    "trial": context.trial,
                    "profile": context.profile,
                    "repetition": context.repetition,
                    "offered_rate": context.offered_rate,
                    "seq": planned.seq,
                    "arrival_s": planned.arrival_s,
                    "adapter": planned.adapter,
                    "prompt_id": planned.prompt_id,
                    "input_bucket": planned.input_bucket,
                    "max_tokens": planned.max_tokens,
                    "expected_revision": expected[planned.adapter],
                    "sent_s": None,
                    "outcome": "dropped",
                    "ttft_ms": None,
                }
                records.append(record)
                if on_handled is not None:
                    on_handled()  # one more planned request handled (sent or dropped)
                if len(tasks) >= concurrency_limit:
                    continue  # dropped: sending it would exceed the generator's limit
                record["sent_s"] = round(time.monotonic() - started, 6)
                record["outcome"], record["code"] = "timeout", "not_finished"
                prompt = prompts[(planned.prompt_id, planned.input_bucket)]
                task = asyncio.create_task(_one(http, planned, prompt, record, timeout_s))
                tasks.add(task)
                task.add_done_callback(tasks.discard)
            if tasks:
                await asyncio.gather(*tasks)
        finally:
            for task in tasks:
                task.cancel()
            stop.set()
            await sampler
        duration = time.monotonic() - started
    return Driven(
        records=[RequestRecord.model_validate(record) for record in records],
        duration_s=round(duration, 3),
        queue_depth=samples.get("queue_depth", []),
        worker_rss_mb=samples.get("worker_rss_mb", []),
        gpu_memory_mb=samples.get("gpu_memory_mb"),
        prefetches={
            name.removeprefix(PREFETCH_PROBE): round(series[-1].value - series[0].value, 3)
            for name, series in samples.items()
            if name.startswith(PREFETCH_PROBE) and series
        },
    )


def is_delayed(record: RequestRecord) -> bool:
    return record.sent_s is not None and record.sent_s - record.arrival_s > LATE_S
