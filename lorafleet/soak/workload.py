"""The soak's traffic: an open-loop mix of the APIs users call (the jobs API with and without a
webhook, OpenAI completions streamed and not, batches), over tenants and tiers; every request's
outcome is kept, down to the job record it ended with.

Arrivals are Poisson at a fixed rate and never wait for answers (open loop: a slow or absent
gateway does not slow the offered load). A caller that uses an idempotency key (jobs, batches)
sends again after a transport error or a 503, as the client library does; a completion is not
sent again (it has no key). Every request asks for greedy tokens with ``ignore_eos``, from a
small set of prompts, so each output can be compared with its reference.
"""

from __future__ import annotations

import asyncio
import json
import random
import time
import uuid
from dataclasses import dataclass, field
from typing import Any

import httpx

PROMPTS = (
    "The weather report for the coast says",
    "Summarise the meeting in one line:",
    "Translate to French: the queue is empty",
)
MAX_TOKENS = 12
BATCH_SIZE = 8
RESUBMIT_FOR_S = 25.0
"""How long a caller with an idempotency key keeps sending again after a transport error:
within the 30 s the gateway holds a key whose first request never finished (a gateway killed
mid-request), past which a resend is admitted anew (``gateway/idempotency.py``)."""
POLL_WAIT_S = 20.0
TERMINAL = ("succeeded", "failed", "cancelled")
BATCH_TERMINAL = ("completed", "cancelled")


@dataclass(frozen=True)
class Caller:
    tenant: str
    key: str
    weight: float


@dataclass(frozen=True)
class Mix:
    """What the traffic is made of; weights need not add up to one."""

    callers: tuple[Caller, ...]
    adapters: dict[str, str]
    """alias -> tier"""
    kinds: dict[str, float] = field(
        default_factory=lambda: {
            "job": 0.30,
            "job_webhook": 0.20,
            "completion": 0.25,
            "stream": 0.20,
            "batch": 0.05,
        }
    )
    tiers: dict[str, float] = field(
        default_factory=lambda: {"hot": 0.6, "warm": 0.25, "cold": 0.15}
    )


@dataclass
class Outcome:
    """One request as its caller saw it, and the job records it ended with."""

    kind: str
    tenant: str
    adapter: str
    prompt: int
    sent_at: float
    """seconds since the run began"""
    refusals: list[tuple[int, str | None]] = field(default_factory=list)
    """(status, error code) of every answer that was not an acceptance"""
    transport_errors: int = 0
    accepted: bool = False
    job_unknown: bool = False
    """a completion whose answer never came: the gateway may have admitted a job its caller
    cannot name (it ends all the same; the soak counts such jobs)"""
    late_error: str | None = None
    """the error code of an accepted completion answered without its result (a 504, say)"""
    job_ids: list[str] = field(default_factory=list)
    batch_id: str | None = None
    done_at: float | None = None
    """when the caller had its result (or knew the job's end)"""
    ttft_s: float | None = None
    text: str | None = None
    """what a completion answered, or what a stream delivered"""
    stream_done: bool = False
    stream_error: dict[str, Any] | None = None
    stream_cut_at: float | None = None
    """when the connection broke mid-stream (a gateway killed): the text is partial"""
    jobs: dict[str, dict[str, Any]] = field(default_factory=dict)
    """job id -> its terminal record (``GET /v1/jobs/{id}``)"""
    batch: dict[str, Any] | None = None
    batch_lines: list[dict[str, Any]] = field(default_factory=list)
    batch_asked: dict[str, tuple[str, int]] = field(default_factory=dict)
    """custom id -> (adapter, prompt index) of each batch line"""
    unresolved: str | None = None
    """why the caller never learnt how its accepted request ended"""
    client_error: str | None = None
    """an exception the soak's own client raised (a bug of the soak, or a malformed answer)"""

    @property
    def latency_s(self) -> float | None:
        return None if self.done_at is None else self.done_at - self.sent_at


class Traffic:
    """Sends the mix open loop at ``rate_per_s`` for ``duration_s``; ``outcomes`` fill in as
    answers come."""

    def __init__(
        self,
        gateway_url: str,
        mix: Mix,
        rate_per_s: float,
        webhook_url: str,
        timeout_s: float,
        seed: int = 7,
    ) -> None:
        self._url = gateway_url
        self._mix = mix
        self._rate = rate_per_s
        self._webhook_url = webhook_url
        self._timeout_s = timeout_s
        """how long a caller waits for an answer (longer than any job may take)"""
        self._random = random.Random(seed)
        self.outcomes: list[Outcome] = []
        self.started = 0.0
        """Origin of ``now`` (monotonic): the run's clock if set before ``run``, so that the
        times of sends, answers and cut streams compare with the fault schedule's."""
        self._tasks: set[asyncio.Task[None]] = set()
        self._by_tier: dict[str, list[str]] = {}
        for alias, tier in sorted(mix.adapters.items()):
            self._by_tier.setdefault(tier, []).append(alias)

    def now(self) -> float:
        return time.monotonic() - self.started

    async def run(self, duration_s: float, finish_by_s: float) -> None:
        """Send for ``duration_s``, then wait up to ``finish_by_s`` more for the answers."""
        limits = httpx.Limits(max_connections=512, max_keepalive_connections=64)
        timeout = httpx.Timeout(self._timeout_s, connect=5)
        async with httpx.AsyncClient(base_url=self._url, limits=limits, timeout=timeout) as http:
            if not self.started:
                self.started = time.monotonic()
            next_at = 0.0
            while next_at < duration_s:
                delay = next_at - self.now()
                if delay > 0:
                    await asyncio.sleep(delay)
                task = asyncio.create_task(self._one(http, self._draw()))
                self._tasks.add(task)
                task.add_done_callback(self._tasks.discard)
                next_at += self._random.expovariate(self._rate)
            if self._tasks:
                _, pending = await asyncio.wait(set(self._tasks), timeout=finish_by_s)
                for task in pending:
                    task.cancel()
                await asyncio.gather(*pending, return_exceptions=True)

    def _draw(self) -> Outcome:
        r = self._random
        caller = r.choices(self._mix.callers, [c.weight for c in self._mix.callers])[0]
        tiers = [t for t in self._mix.tiers if self._by_tier.get(t)]
        tier = r.choices(tiers, [self._mix.tiers[t] for t in tiers])[0]
        kinds = list(self._mix.kinds)
        outcome = Outcome(
            kind=r.choices(kinds, [self._mix.kinds[k] for k in kinds])[0],
            tenant=caller.tenant,
            adapter=r.choice(self._by_tier[tier]),
            prompt=r.randrange(len(PROMPTS)),
            sent_at=self.now(),
        )
        self.outcomes.append(outcome)
        return outcome

    def _headers(self, outcome: Outcome) -> dict[str, str]:
        caller = next(c for c in self._mix.callers if c.tenant == outcome.tenant)
        return {"Authorization": f"Bearer {caller.key}"}

    async def _one(self, http: httpx.AsyncClient, outcome: Outcome) -> None:
        try:
            if outcome.kind in ("job", "job_webhook"):
                await self._job(http, outcome)
            elif outcome.kind == "completion":
                await self._completion(http, outcome)
            elif outcome.kind == "stream":
                await self._stream(http, outcome)
            else:
                await self._batch(http, outcome)
        except asyncio.CancelledError:
            outcome.unresolved = outcome.unresolved or "still waiting when the run ended"
            raise
        except Exception as exc:  # the client's own failure: reported, never excused
            outcome.client_error = repr(exc)

    def _job_body(self, outcome: Outcome, webhook: bool) -> dict[str, Any]:
        body: dict[str, Any] = {
            "adapter": outcome.adapter,
            "prompt": PROMPTS[outcome.prompt],
            "sampling": {"max_tokens": MAX_TOKENS, "temperature": 0.0, "ignore_eos": True},
        }
        if webhook:
            body["webhook"] = {"url": self._webhook_url}
        return body

    async def _submit(
        self, http: httpx.AsyncClient, outcome: Outcome, path: str, body: dict[str, Any]
    ) -> dict[str, Any] | None:
        """POST with an idempotency key, sent again after a transport error or a 503 for up
        to ``RESUBMIT_FOR_S``; the accepted body, or ``None`` if refused."""
        headers = {**self._headers(outcome), "Idempotency-Key": uuid.uuid4().hex}
        give_up = time.monotonic() + RESUBMIT_FOR_S
        while True:
            try:
                response = await http.post(path, json=body, headers=headers)
            except httpx.TransportError:
                outcome.transport_errors += 1
                response = None
            if response is not None:
                if response.status_code in (200, 202):
                    outcome.accepted = True
                    accepted: dict[str, Any] = response.json()
                    return accepted
                outcome.refusals.append((response.status_code, _code(response)))
                if response.status_code != 503:
                    return None
            if time.monotonic() > give_up:
                return None
            await asyncio.sleep(1.0)

    async def _job(self, http: httpx.AsyncClient, outcome: Outcome) -> None:
        body = self._job_body(outcome, webhook=outcome.kind == "job_webhook")
        accepted = await self._submit(http, outcome, "/v1/jobs", body)
        if accepted is None:
            return
        outcome.job_ids.append(str(accepted["id"]))
        await self._wait_jobs(http, outcome)

    async def _wait_jobs(self, http: httpx.AsyncClient, outcome: Outcome) -> None:
        """Long-poll each job until it ended; through gateway restarts (transport errors and
        503s are waited out, as a caller would)."""
        for job_id in outcome.job_ids:
            while True:
                try:
                    response = await http.get(
                        f"/v1/jobs/{job_id}",
                        params={"wait_s": POLL_WAIT_S},
                        headers=self._headers(outcome),
                    )
                except httpx.TransportError:
                    await asyncio.sleep(0.5)
                    continue
                if response.status_code == 404:
                    outcome.unresolved = f"job {job_id}: 404 {response.text[:200]}"
                    return
                if response.status_code != 200:
                    await asyncio.sleep(0.5)
                    continue
                record: dict[str, Any] = response.json()
                if record["status"] in TERMINAL:
                    outcome.jobs[job_id] = record
                    break
        outcome.done_at = self.now()

    @staticmethod
    def _completion_body(outcome: Outcome, stream: bool) -> dict[str, Any]:
        return {
            "model": outcome.adapter,
            "prompt": PROMPTS[outcome.prompt],
            "max_tokens": MAX_TOKENS,
            "temperature": 0.0,
            "ignore_eos": True,
            "stream": stream,
        }

    async def _completion(self, http: httpx.AsyncClient, outcome: Outcome) -> None:
        body = self._completion_body(outcome, stream=False)
        try:
            response = await http.post("/v1/completions", json=body, headers=self._headers(outcome))
        except httpx.TransportError:
            outcome.transport_errors += 1
            outcome.job_unknown = True
            return
        job_id = response.headers.get("x-lorafleet-job-id")
        if response.status_code != 200:
            if job_id:  # accepted, then not answered with its result (a 504, say)
                outcome.accepted = True
                outcome.late_error = _code(response) or str(response.status_code)
                outcome.job_ids.append(job_id)
                await self._wait_jobs(http, outcome)
            else:
                outcome.refusals.append((response.status_code, _code(response)))
            return
        outcome.accepted = True
        outcome.text = response.json()["choices"][0]["text"]
        outcome.job_ids.append(str(job_id))
        done_at = self.now()
        await self._wait_jobs(http, outcome)
        outcome.done_at = done_at

    async def _stream(self, http: httpx.AsyncClient, outcome: Outcome) -> None:
        body = self._completion_body(outcome, stream=True)
        text = ""
        done_at: float | None = None
        try:
            async with http.stream(
                "POST", "/v1/completions", json=body, headers=self._headers(outcome)
            ) as response:
                if response.status_code != 200:
                    await response.aread()
                    outcome.refusals.append((response.status_code, _code(response)))
                    return
                outcome.accepted = True
                outcome.job_ids.append(str(response.headers.get("x-lorafleet-job-id")))
                async for line in response.aiter_lines():
                    if not line.startswith("data: "):
                        continue
                    if line == "data: [DONE]":
                        outcome.stream_done = True
                        done_at = self.now()
                        break
                    event = json.loads(line.removeprefix("data: "))
                    if "error" in event:
                        outcome.stream_error = event["error"]
                    for choice in event.get("choices", ()):
                        if choice.get("text") and outcome.ttft_s is None:
                            outcome.ttft_s = self.now() - outcome.sent_at
                        text += choice.get("text") or ""
        except httpx.TransportError:
            outcome.transport_errors += 1
            if not outcome.accepted:
                outcome.job_unknown = True
                return
            outcome.stream_cut_at = self.now()
        outcome.text = text
        await self._wait_jobs(http, outcome)
        if done_at is not None:
            outcome.done_at = done_at

    async def _batch(self, http: httpx.AsyncClient, outcome: Outcome) -> None:
        # A batch spans the adapters of its drawn tier, one prompt each in turn.
        tier = self._mix.adapters[outcome.adapter]
        aliases = self._by_tier[tier]
        requests = []
        for i in range(BATCH_SIZE):
            line = Outcome("batch", outcome.tenant, aliases[i % len(aliases)], i % len(PROMPTS), 0)
            outcome.batch_asked[f"r{i}"] = (line.adapter, line.prompt)
            requests.append({"custom_id": f"r{i}", **self._job_body(line, webhook=False)})
        body = {"requests": requests, "webhook": {"url": self._webhook_url}}
        accepted = await self._submit(http, outcome, "/v1/batches", body)
        if accepted is None:
            return
        batch_id = str(accepted["id"])
        outcome.batch_id = batch_id
        while True:
            try:
                response = await http.get(f"/v1/batches/{batch_id}", headers=self._headers(outcome))
                if response.status_code == 200 and response.json()["status"] in BATCH_TERMINAL:
                    outcome.batch = response.json()
                    lines = await http.get(
                        f"/v1/batches/{batch_id}/results", headers=self._headers(outcome)
                    )
                    if lines.status_code == 200:
                        outcome.batch_lines = [json.loads(x) for x in lines.text.splitlines()]
                        break
            except httpx.TransportError:
                pass
            await asyncio.sleep(1.0)
        outcome.job_ids = [str(line["job_id"]) for line in outcome.batch_lines]
        outcome.done_at = self.now()


def _code(response: httpx.Response) -> str | None:
    try:
        return str(response.json()["error"]["code"])
    except (ValueError, KeyError, TypeError):
        return None
