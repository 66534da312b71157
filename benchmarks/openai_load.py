"""A cheap load generator for OpenAI-compatible ``POST /v1/completions``, and its statistics.

It runs on aiohttp because it shares the cores with the servers it measures: httpx costs
about 20x its CPU for the same burst (``throughput.Load``). It asks for usage (from the
body, or ``stream_options.include_usage`` when streaming) and counts tokens from it, never
from chunks: a server may put several tokens in one chunk, or none.

A request failed if it was not answered 200, its stream held an error event or no
``[DONE]``, it got fewer tokens than asked for, or the connection failed. TTFT is the time
to the first chunk with text; time per output token (TPOT) is (last chunk with text - first)
/ (tokens - 1); end to end runs to ``[DONE]``, or to the end of an unstreamed body.
"""

from __future__ import annotations

import asyncio
import json
import time
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import aiohttp


@dataclass(frozen=True)
class Scenario:
    """Requests sent in order by ``concurrency`` lanes that start together (each sends its
    next request when its last one ended): with as many lanes as requests, all go at once."""

    name: str
    stream: bool
    concurrency: int
    work: tuple[tuple[str, str], ...]  # (model, prompt)
    max_tokens: int

    def body(self, model: str, prompt: str) -> dict[str, Any]:
        """Greedy and ``ignore_eos``: every request generates exactly ``max_tokens``."""
        body: dict[str, Any] = {
            "model": model,
            "prompt": prompt,
            "max_tokens": self.max_tokens,
            "temperature": 0.0,
            "ignore_eos": True,
            "stream": self.stream,
        }
        if self.stream:
            body["stream_options"] = {"include_usage": True}
        return body


@dataclass
class Outcome:
    """One request. Times in seconds from its start; ``error`` is set if it failed."""

    error: str | None = None  # "<kind>: <detail>"
    error_kind: str | None = None  # "HTTP 503", "error event", "ClientPayloadError", ...
    tokens: int = 0
    prompt_tokens: int = 0
    first_s: float | None = None  # first chunk with text (streamed)
    last_s: float | None = None  # last chunk with text (streamed)
    e2e_s: float = 0.0
    sent_at: float = 0.0  # wall clock (time.time()) when it was sent
    job_id: str | None = None  # lorafleet's job, if the answer named it
    metadata: dict[str, Any] | None = None  # lorafleet's result metadata, if the answer had it

    def fail(self, kind: str, detail: str = "") -> None:
        if self.error is None:  # the first reason is the one worth reading
            self.error_kind = kind
            self.error = f"{kind}: {detail}" if detail else kind

    def read_usage(self, answer: dict[str, Any]) -> None:
        self.tokens = int(answer["usage"]["completion_tokens"])
        self.prompt_tokens = int(answer["usage"]["prompt_tokens"])

    def read_metadata(self, answer: dict[str, Any]) -> None:
        """lorafleet's metadata of the job (in its answer, or its stream's last chunk)."""
        info = answer.get("lorafleet")
        if isinstance(info, dict):
            self.job_id = info.get("job_id")
            if isinstance(info.get("metadata"), dict):
                self.metadata = info["metadata"]


async def _read_stream(response: aiohttp.ClientResponse, outcome: Outcome, start: float) -> None:
    done = counted = False
    async for line in response.content:
        if not line.startswith(b"data: "):
            continue
        data = line.removeprefix(b"data: ").strip()
        if data == b"[DONE]":
            done = True
            continue
        chunk = json.loads(data)
        if "error" in chunk:
            outcome.fail("error event", str(chunk["error"].get("message")))
        choices = chunk.get("choices")
        if choices and choices[0].get("text"):
            outcome.last_s = time.perf_counter() - start
            outcome.first_s = outcome.first_s or outcome.last_s
        if chunk.get("usage"):
            outcome.read_usage(chunk)
            counted = True
        outcome.read_metadata(chunk)
    if not done:
        outcome.fail("no [DONE]", "the stream ended without it")
    elif outcome.first_s is None:
        outcome.fail("no text", "the stream held none")
    elif not counted:
        outcome.fail("no usage", "the stream held none")


async def complete(http: aiohttp.ClientSession, body: dict[str, Any]) -> Outcome:
    """Send one completion request and read its answer to the end."""
    outcome = Outcome(sent_at=time.time())
    start = time.perf_counter()
    try:
        async with http.post("/v1/completions", json=body) as response:
            if response.status != 200:
                outcome.fail(f"HTTP {response.status}", (await response.text())[:300])
            elif body["stream"]:
                await _read_stream(response, outcome, start)
            else:
                answer = json.loads(await response.read())
                outcome.read_usage(answer)
                outcome.read_metadata(answer)
    except (aiohttp.ClientError, TimeoutError, ValueError, KeyError) as exc:
        outcome.fail(type(exc).__name__, str(exc))
    outcome.e2e_s = time.perf_counter() - start
    if outcome.error is None and outcome.tokens < body["max_tokens"]:
        outcome.fail("too few tokens", f"{outcome.tokens} of {body['max_tokens']}")
    return outcome


@dataclass
class Run:
    """A scenario's outcomes, in sending order, and its wall time."""

    outcomes: list[Outcome]
    elapsed_s: float


async def run(
    url: str,
    headers: dict[str, str],
    scenario: Scenario,
    timeout_s: float,
    pause: Callable[[], float] | None = None,
) -> Run:
    """Every request of ``scenario`` against the server at ``url``, on fresh connections;
    ``timeout_s`` bounds each request. ``pause``: seconds a lane waits before each send (a
    request's times, ``sent_at`` included, start after it)."""
    connector = aiohttp.TCPConnector(limit=scenario.concurrency)
    timeout = aiohttp.ClientTimeout(total=timeout_s)
    async with aiohttp.ClientSession(
        url, headers=headers, connector=connector, timeout=timeout
    ) as http:
        ended: dict[int, Outcome] = {}
        pending = iter(enumerate(scenario.work))

        async def lane() -> None:
            for index, (model, prompt) in pending:
                if pause is not None:
                    await asyncio.sleep(pause())
                ended[index] = await complete(http, scenario.body(model, prompt))

        start = time.perf_counter()
        await asyncio.gather(*(lane() for _ in range(scenario.concurrency)))
        elapsed_s = time.perf_counter() - start
    return Run([ended[index] for index in range(len(scenario.work))], elapsed_s)


def percentile(values: list[float], q: float) -> float | None:
    """The ``q``-th percentile (linear between closest ranks); ``None`` without values."""
    if not values:
        return None
    ordered = sorted(values)
    rank = (len(ordered) - 1) * q / 100
    low = int(rank)
    high = min(low + 1, len(ordered) - 1)
    return ordered[low] + (ordered[high] - ordered[low]) * (rank - low)


@dataclass
class Summary:
    """Runs of one scenario pooled: latencies over all their requests (ms), throughput as
    their successful requests and tokens over their summed wall time."""

    ok: int
    failed: int
    failures: dict[str, int]  # kind of failure -> requests
    first_failure: str | None
    req_per_s: float
    tok_per_s: float
    ttft_p50_ms: float | None
    ttft_p99_ms: float | None
    tpot_p50_ms: float | None
    e2e_p50_ms: float | None
    e2e_p99_ms: float | None


def summarise(runs: list[Run]) -> Summary:
    outcomes = [outcome for run in runs for outcome in run.outcomes]
    good = [outcome for outcome in outcomes if outcome.error is None]
    failures = [outcome for outcome in outcomes if outcome.error is not None]
    kinds = Counter(str(outcome.error_kind) for outcome in failures)
    elapsed_s = sum(run.elapsed_s for run in runs)
    ttft = [o.first_s * 1000 for o in good if o.first_s is not None]
    tpot = [
        (o.last_s - o.first_s) * 1000 / (o.tokens - 1)
        for o in good
        if o.first_s is not None and o.last_s is not None and o.tokens > 1
    ]
    e2e = [o.e2e_s * 1000 for o in good]
    return Summary(
        ok=len(good),
        failed=len(failures),
        failures=dict(kinds.most_common()),
        first_failure=failures[0].error if failures else None,
        req_per_s=len(good) / elapsed_s if elapsed_s else 0.0,
        tok_per_s=sum(o.tokens for o in good) / elapsed_s if elapsed_s else 0.0,
        ttft_p50_ms=percentile(ttft, 50),
        ttft_p99_ms=percentile(ttft, 99),
        tpot_p50_ms=percentile(tpot, 50),
        e2e_p50_ms=percentile(e2e, 50),
        e2e_p99_ms=percentile(e2e, 99),
    )
