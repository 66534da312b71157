"""``lorafleet.client`` against the session's gateway (real stack): every method, typed
errors carrying our codes, ``Retry-After`` honoured, idempotency keys on creates, and the
receivers' webhook check."""

from __future__ import annotations

import asyncio
import json
import time
import uuid
from pathlib import Path
from typing import Any

import httpx
import pytest
from redis import Redis

from contracts.batches import BatchPublic
from contracts.errors import ErrorCode
from contracts.jobs import JobStatus
from contracts.registry import AdapterRecord
from contracts.tenants import ALL_ADAPTERS, TenantLimits
from contracts.webhooks import headers as signed_headers
from contracts.webhooks import new_secret
from lorafleet.client import (
    AsyncClient,
    Client,
    Conflict,
    GatewayError,
    InvalidRequest,
    NotFound,
    RateLimited,
    Unauthorized,
    verify_webhook,
)
from lorafleet.tenants import Tenants
from tests.helpers import hot_alias, job_records

GREEDY = {"max_tokens": 4, "temperature": 0.0}


def test_jobs_batches_and_the_fleet_through_the_blocking_client(
    gateway_url: str,
    api_key: str,
    redis: Redis,
    published: dict[str, AdapterRecord],
    tmp_path: Path,
) -> None:
    alias = hot_alias(published)
    with Client(gateway_url, api_key) as client:
        accepted = client.create_job(alias, "Summarise the call", sampling=GREEDY)
        job = client.wait_job(accepted.id, timeout_s=120)
        assert job.status == JobStatus.SUCCEEDED and job.result is not None
        assert job.metadata is not None and job.metadata.identity_verified
        assert client.get_job(accepted.id).id == accepted.id
        # An idempotency key given twice: the job it admitted first, not a second one.
        key = uuid.uuid4().hex
        first = client.create_job(alias, "Hello", sampling=GREEDY, idempotency_key=key)
        assert client.create_job(alias, "Hello", sampling=GREEDY, idempotency_key=key).id == (
            first.id
        )
        client.wait_job(first.id, timeout_s=120)
        with pytest.raises(Conflict) as finished:
            client.cancel_job(first.id)
        assert finished.value.code == ErrorCode.JOB_FINISHED
        # A batch from a list; its progress is reported until it has ended.
        seen: list[BatchPublic] = []
        requests = [{"adapter": alias, "prompt": f"Line {n}", "sampling": GREEDY} for n in range(3)]
        batch = client.create_batch(requests)
        done = client.wait_batch(batch.id, timeout_s=300, poll_s=0.2, progress=seen.append)
        assert done.status == "completed" and done.counts.succeeded == 3
        assert seen and seen[-1].status == "completed"
        results = list(client.batch_results(batch.id))
        assert len(results) == 3 and {r["status"] for r in results} == {"succeeded"}
        # ... and from a JSONL file.
        path = tmp_path / "batch.jsonl"
        path.write_text("".join(json.dumps(r) + "\n" for r in requests[:2]))
        from_file = client.wait_batch(client.create_batch(path).id, timeout_s=300, poll_s=0.2)
        assert from_file.counts.succeeded == 2
        # Cancelling a batch that has ended changes nothing (OpenAI's behaviour).
        assert client.cancel_batch(from_file.id).status == "completed"
        # Typed refusals, each with its stable code.
        with pytest.raises(NotFound) as missing:
            client.create_job("no-such-adapter", "hi")
        assert missing.value.code == ErrorCode.ADAPTER_NOT_FOUND and missing.value.message
        with pytest.raises(InvalidRequest) as invalid:
            client.create_job(alias, "")
        assert invalid.value.code == ErrorCode.VALIDATION_ERROR
        with pytest.raises(NotFound) as no_job:
            client.get_job("0" * 32)
        assert no_job.value.code == ErrorCode.JOB_NOT_FOUND
        with pytest.raises(Unauthorized) as forbidden:
            client.fleet()  # the dev tenant is no operator
        assert forbidden.value.code == ErrorCode.FORBIDDEN
    _, operator = Tenants(redis).create(f"client-ops-{time.monotonic_ns()}", operator=True)
    with Client(gateway_url, operator) as client:
        fleet = client.fleet()
        assert any(view.queue == job.queue for view in fleet.tiers)
    with Client(gateway_url, "lf_wrong_key") as client, pytest.raises(Unauthorized) as denied:
        client.get_job(accepted.id)
    assert denied.value.code == ErrorCode.UNAUTHORIZED


def test_the_async_client_retries_a_rate_refusal_after_its_retry_after(
    gateway_url: str, redis: Redis, published: dict[str, AdapterRecord]
) -> None:
    tenants = Tenants(redis)
    name = f"client-rate-{time.monotonic_ns()}"
    # A token every 5 s: the second create comes well within it, however slow the machine.
    _, key = tenants.create(name, TenantLimits(rate_per_s=0.2, burst=1))
    tenants.grant(name, ALL_ADAPTERS)
    alias = hot_alias(published)

    async def go() -> tuple[Any, ...]:
        async with AsyncClient(gateway_url, key, max_retries=0) as impatient:
            first = await impatient.create_job(alias, "one", sampling=GREEDY)
            with pytest.raises(RateLimited) as refused:
                await impatient.create_job(alias, "two", sampling=GREEDY)
        async with AsyncClient(gateway_url, key, max_retries=3) as patient:
            second = await patient.create_job(alias, "two", sampling=GREEDY)
            jobs = [await patient.wait_job(j.id, 120) for j in (first, second)]
        return refused.value, jobs

    refusal, jobs = asyncio.run(go())
    assert refusal.code == ErrorCode.TENANT_RATE_EXCEEDED and refusal.retry_after_s >= 1
    assert isinstance(refusal, GatewayError) and refusal.status_code == 429
    assert [job.status for job in jobs] == [JobStatus.SUCCEEDED, JobStatus.SUCCEEDED]


class _LosesFirstReply(httpx.AsyncBaseTransport):
    """Forwards every request; the first POST's reply is lost on the way back (the gateway
    did admit it)."""

    def __init__(self) -> None:
        self.inner = httpx.AsyncHTTPTransport()
        self.posts: list[str | None] = []

    async def handle_async_request(self, request: httpx.Request) -> httpx.Response:
        response = await self.inner.handle_async_request(request)
        if request.method == "POST":
            self.posts.append(request.headers.get("Idempotency-Key"))
            if len(self.posts) == 1:
                await response.aread()
                raise httpx.ReadError("connection reset by peer", request=request)
        return response

    async def aclose(self) -> None:
        await self.inner.aclose()


def test_a_batch_create_whose_reply_was_lost_is_sent_again_and_admitted_once(
    gateway_url: str, api_key: str, redis: Redis, published: dict[str, AdapterRecord]
) -> None:
    alias = hot_alias(published)
    requests = [{"adapter": alias, "prompt": f"Lost {n}", "sampling": GREEDY} for n in range(2)]
    lossy = _LosesFirstReply()

    async def go() -> BatchPublic:
        async with AsyncClient(gateway_url, api_key, transport=lossy) as client:
            batch = await client.create_batch(requests)
            return await client.wait_batch(batch.id, timeout_s=300, poll_s=0.2)

    before = job_records(redis)
    batch = asyncio.run(go())
    assert len(lossy.posts) == 2 and lossy.posts[0] == lossy.posts[1] is not None
    assert batch.status == "completed" and batch.counts.succeeded == 2
    assert job_records(redis) == before + 2  # admitted once: 2 jobs, not 4


def test_verify_webhook_accepts_our_signature_and_refuses_anything_else() -> None:
    secret, other = new_secret(), new_secret()
    body = json.dumps({"type": "job.succeeded", "data": {"id": "j1"}}).encode()
    now = int(time.time())
    headers = signed_headers([other, secret], "evt_1", now, body)  # during a rotation: both
    assert verify_webhook(headers, body, secret) == json.loads(body)
    with pytest.raises(ValueError, match="no webhook signature"):
        verify_webhook(headers, body + b" ", secret)
    with pytest.raises(ValueError, match="no webhook signature"):
        verify_webhook(signed_headers([other], "evt_1", now, body), body, secret)
    with pytest.raises(ValueError, match="outside"):
        verify_webhook(signed_headers([secret], "evt_1", now - 3600, body), body, secret)
    with pytest.raises(ValueError, match="not a signed webhook"):
        verify_webhook({"content-type": "application/json"}, body, secret)
    garbled = {**headers, "webhook-signature": "v1,é"}  # a 400 for the receiver, not a 500
    with pytest.raises(ValueError, match="no webhook signature"):
        verify_webhook(garbled, body, secret)
