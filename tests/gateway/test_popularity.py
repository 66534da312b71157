"""The gateway counts admitted jobs per adapter revision and pool (jobs and batches, never
an idempotent replay or a refusal) into the decayed counts the workers read."""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Any

import httpx
import pytest
from redis import Redis

from contracts import popularity
from contracts.queues import Tier, pool_id
from contracts.registry import AdapterRecord
from lorafleet.client import auth_headers


def _counts(redis: Redis, pool: str) -> dict[str, float]:
    now = time.time()
    epoch = popularity.epoch_of(now)
    current = redis.zrevrange(popularity.popularity_key(pool, epoch), 0, -1, withscores=True)
    previous = redis.zrevrange(popularity.popularity_key(pool, epoch - 1), 0, -1, withscores=True)
    return popularity.decayed(current, previous, now, epoch)  # type: ignore[arg-type]


def test_admitted_jobs_and_batches_are_counted_once_per_job(
    private_gateway: Callable[..., Any],
    tenant_key: Callable[..., str],
    private_redis: Redis,
    published: dict[str, AdapterRecord],
) -> None:
    cold = sorted((r for r in published.values() if r.tier == Tier.COLD), key=lambda r: r.alias)
    a, b = cold[0], cold[1]
    pool = pool_id(a.base_model.digest)
    key = tenant_key("counted", max_concurrent=7)
    job = {"adapter": a.alias, "prompt": "hello"}
    with private_gateway() as url, httpx.Client(base_url=url, headers=auth_headers(key)) as http:
        for n in range(3):
            assert http.post("/v1/jobs", json={**job, "prompt": f"hi {n}"}).status_code == 202
        replayed = {"Idempotency-Key": "once"}
        assert http.post("/v1/jobs", json=job, headers=replayed).status_code == 202
        assert http.post("/v1/jobs", json=job, headers=replayed).status_code == 200  # replay
        batch = {"requests": [{"adapter": b.alias, "prompt": f"b {n}"} for n in range(3)]}
        assert http.post("/v1/batches", json=batch).status_code == 202
        # Refused (the tenant's 7 places are taken): not counted.
        assert http.post("/v1/jobs", json={"adapter": b.alias, "prompt": "x"}).status_code == 429
        deadline = time.monotonic() + 10
        while len(_counts(private_redis, pool)) < 2 and time.monotonic() < deadline:
            time.sleep(0.1)
    counts = _counts(private_redis, pool)
    assert counts == {
        popularity.member(a.digest, a.alias): pytest.approx(4.0, rel=0.05),
        popularity.member(b.digest, b.alias): pytest.approx(3.0, rel=0.05),
    }
