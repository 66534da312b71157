"""``POST /v1/batches`` with an ``Idempotency-Key``: the same key and body is the same batch,
admitted once however many times (and however concurrently) it is sent; a different body
under the key is a conflict; a refused batch frees its key for a retry."""

from __future__ import annotations

import asyncio
import json
from collections.abc import Callable
from typing import Any

import httpx
from redis import Redis

from contracts.queues import Tier
from contracts.registry import AdapterRecord
from lorafleet.client import auth_headers
from tests.gateway.conftest import NOTHING, admitted_state


def _cold(published: dict[str, AdapterRecord]) -> str:
    return next(r.alias for r in published.values() if r.tier == Tier.COLD)


def _batch(adapter: str, size: int, prompt: str = "hello") -> dict[str, Any]:
    return {
        "requests": [
            {"custom_id": f"r{n}", "adapter": adapter, "prompt": f"{prompt} {n}"}
            for n in range(size)
        ]
    }


async def _post_all(url: str, key: str, body: dict[str, Any], times: int, idem: str) -> list[Any]:
    async with httpx.AsyncClient(base_url=url, headers=auth_headers(key), timeout=30) as http:
        headers = {"Idempotency-Key": idem}
        sends = (http.post("/v1/batches", json=body, headers=headers) for _ in range(times))
        return list(await asyncio.gather(*sends))


def test_a_batch_sent_again_with_its_key_is_admitted_once_even_concurrently(
    private_gateway: Callable[..., Any],
    tenant_key: Callable[..., str],
    private_redis: Redis,
    published: dict[str, AdapterRecord],
) -> None:
    key = tenant_key("acme")
    body = _batch(_cold(published), 3)
    with private_gateway() as url:
        answers = asyncio.run(_post_all(url, key, body, 8, "nightly-2026-12-04"))
        assert sorted(a.status_code for a in answers) == [200] * 7 + [202], [
            a.text for a in answers
        ]
        ids = {a.json()["id"] for a in answers}
        assert len(ids) == 1
        batch_id = ids.pop()
        assert all(a.headers["Location"] == f"/v1/batches/{batch_id}" for a in answers)
        assert {a.json()["request_counts"]["total"] for a in answers} == {3}
        with httpx.Client(base_url=url, headers=auth_headers(key)) as http:
            # The same jobs as JSONL are another body: a conflict naming the earlier batch.
            jsonl = "\n".join(json.dumps(r) for r in body["requests"])
            other = http.post(
                "/v1/batches",
                content=jsonl,
                headers={
                    "Idempotency-Key": "nightly-2026-12-04",
                    "Content-Type": "application/jsonl",
                },
            )
            assert other.status_code == 409, other.text
            assert other.json()["error"]["code"] == "idempotency_conflict"
            assert batch_id in other.json()["error"]["message"]
            # A job under the batch's key: a conflict too, not a second admission.
            job = {"adapter": _cold(published), "prompt": "hello"}
            as_job = http.post(
                "/v1/jobs", json=job, headers={"Idempotency-Key": "nightly-2026-12-04"}
            )
            assert as_job.status_code == 409
            assert as_job.json()["error"]["code"] == "idempotency_conflict"
    state = admitted_state(private_redis, "acme")
    assert state == NOTHING | {
        "records": 3,
        "batches": 2,  # the batch's hash and its list of jobs
        "idempotency_keys": 1,
        "pool_ledgers": 3,
        "tenant_ledger": 3,
        "queued": 3,
        "deadlines": 3,
    }


def test_a_refused_batch_frees_its_key_for_a_retry(
    private_gateway: Callable[..., Any],
    tenant_key: Callable[..., str],
    private_redis: Redis,
    published: dict[str, AdapterRecord],
) -> None:
    key = tenant_key("acme", max_concurrent=3)
    cold = _cold(published)
    with private_gateway() as url, httpx.Client(base_url=url, headers=auth_headers(key)) as http:
        # Refused before the admission script: larger than the tenant's limit, ever.
        never = http.post("/v1/batches", json=_batch(cold, 4), headers={"Idempotency-Key": "a"})
        assert never.status_code == 422, never.text
        assert never.json()["error"]["code"] == "batch_exceeds_limits"
        assert admitted_state(private_redis, "acme") == NOTHING
        # Refused by the admission script: one slot is taken by a job.
        first = http.post("/v1/jobs", json={"adapter": cold, "prompt": "first"})
        assert first.status_code == 202
        body = _batch(cold, 3)
        refused = http.post("/v1/batches", json=body, headers={"Idempotency-Key": "b"})
        assert refused.status_code == 429, refused.text
        assert admitted_state(private_redis, "acme")["idempotency_keys"] == 0
        assert http.delete(f"/v1/jobs/{first.json()['id']}").status_code == 200
        retried = http.post("/v1/batches", json=body, headers={"Idempotency-Key": "b"})
        assert retried.status_code == 202, retried.text
        again = http.post("/v1/batches", json=body, headers={"Idempotency-Key": "b"})
        assert again.status_code == 200 and again.json()["id"] == retried.json()["id"]
