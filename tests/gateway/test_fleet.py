"""``GET /v1/fleet``: operators see queues, workers and recommended replicas; others don't."""

from __future__ import annotations

import asyncio
import json
import math
import time
from collections.abc import Callable
from typing import Any

import httpx
from redis import Redis

from contracts.keys import POOLS, WORKERS_INDEX, worker_key
from contracts.queues import Tier, pool_id, queue_for
from contracts.registry import AdapterRecord, BaseModelRef
from contracts.tenants import ALL_ADAPTERS, TenantLimits
from lorafleet.client import auth_headers
from lorafleet.tenants import Tenants


def test_fleet_shows_the_live_worker_and_its_pinned_adapters(
    gateway_url: str, api: httpx.Client, redis: Redis, published: dict[str, AdapterRecord]
) -> None:
    tenants = Tenants(redis)
    _, key = tenants.create(f"ops-{time.monotonic_ns()}", operator=True)
    forbidden = api.get("/v1/fleet")
    assert forbidden.status_code == 403
    assert forbidden.json()["error"]["code"] == "forbidden"

    fleet = httpx.get(f"{gateway_url}/v1/fleet", headers=auth_headers(key)).json()
    assert [t["tier"] for t in fleet["tiers"]] == ["hot", "warm", "cold"]
    hot_aliases = {r.alias for r in published.values() if r.tier == Tier.HOT}
    for tier in fleet["tiers"]:
        (worker,) = tier["workers"]  # the session's one worker consumes every tier
        assert tier["queue"] in worker["queues"]
        assert {name.split("@")[0] for name in worker["pinned"]} == hot_aliases
        assert worker["free_slots"] <= 32 and worker["seen_s_ago"] < 30
        # Routing's view of it: its own queue (the session's one worker: nothing routed to
        # it) and the adapters it holds, its pinned hot ones among them.
        assert worker["own_queue"] == f"lorafleet.worker.{worker['worker_id']}"
        assert worker["own_queue_depth"] == 0
        load = math.ceil(tier["admitted_unfinished"] / 64)
        assert tier["recommended_replicas"] >= max(1 if tier["tier"] == "hot" else 0, load)
    assert "ceil(admitted_unfinished / 64)" in fleet["formula"]
    # Published at least every second (the engine's answer may lag its first announcement).
    deadline = time.monotonic() + 15
    while True:
        (worker, *_) = fleet["tiers"][0]["workers"]
        if worker["adapters_held"].get("pinned") == len(hot_aliases) or time.monotonic() > deadline:
            break
        time.sleep(0.5)
        fleet = httpx.get(f"{gateway_url}/v1/fleet", headers=auth_headers(key)).json()
    assert worker["adapters_held"].get("pinned") == len(hot_aliases), worker["adapters_held"]


def test_recommended_replicas_follow_load_and_queue_age(
    private_gateway: Callable[..., Any],
    private_redis: Redis,
    published: dict[str, AdapterRecord],
) -> None:
    tenants = Tenants(private_redis)
    _, operator = tenants.create("ops", TenantLimits(max_concurrent=1000), operator=True)
    tenants.grant("ops", ALL_ADAPTERS)
    cold_record = next(r for r in published.values() if r.tier == Tier.COLD)
    cold = cold_record.alias
    # A second base model's pool: known (an adapter was published for it), nothing admitted.
    other = BaseModelRef(id="other-model", digest="sha256:" + "e" * 64)
    private_redis.hset(POOLS, pool_id(other.digest), other.model_dump_json())

    async def submit(url: str, count: int) -> None:
        async with httpx.AsyncClient(base_url=url, headers=auth_headers(operator)) as http:
            body = {"adapter": cold, "prompt": "hi"}
            posts = [http.post("/v1/jobs", json=body) for _ in range(count)]
            assert {a.status_code for a in await asyncio.gather(*posts)} == {202}

    # Load alone decides while no job has waited an hour; the age bound is checked below, on a
    # second gateway over the same database (a slow machine cannot age the jobs before that).
    settings = {"fleet_target_jobs_per_worker": 10, "fleet_max_queue_age_s": 3600.0}
    with (
        private_gateway(**settings) as url,
        httpx.Client(base_url=url, headers=auth_headers(operator)) as http,
    ):
        asyncio.run(submit(url, 25))
        entries = http.get("/v1/fleet").json()["tiers"]
        # one entry per tier of each pool, each naming its base model and queue
        assert sorted((t["base_model"]["id"], t["tier"]) for t in entries) == sorted(
            (base.id, tier.value) for base in (cold_record.base_model, other) for tier in Tier
        )
        others = [t for t in entries if t["pool"] == pool_id(other.digest)]
        assert {t["queue"] for t in others} == {queue_for(tier, other.digest) for tier in Tier}
        assert all(t["admitted_unfinished"] == 0 and t["queue_depth"] == 0 for t in others)
        mine = cold_record.base_model.digest
        tiers = {t["tier"]: t for t in entries if t["base_model"]["digest"] == mine}
        assert tiers["cold"]["queue_depth"] == 25 and tiers["cold"]["admitted_unfinished"] == 25
        assert tiers["cold"]["recommended_replicas"] == 3  # ceil(25 / 10), no worker yet
        assert tiers["hot"]["recommended_replicas"] == 1  # always on
        assert tiers["warm"]["recommended_replicas"] == 0  # scales to zero
        # Three cold workers announce themselves (busy, so none takes the queued jobs here).
        for n in range(3):
            worker_id = f"host:{n}"
            record = {
                "worker_id": worker_id,
                "queues": [queue_for(Tier.COLD, mine)],
                "pinned": [],
                "warm_preloaded": [],
                "jobs_running": 8,
                "concurrency": 10,
                "seen_at": time.time(),
            }
            private_redis.set(worker_key(worker_id), json.dumps(record), ex=60)
            private_redis.sadd(WORKERS_INDEX, worker_id)
        served = next(
            t for t in http.get("/v1/fleet").json()["tiers"] if t["queue"] == tiers["cold"]["queue"]
        )
        assert len(served["workers"]) == 3 and served["free_slots"] == 6
        assert served["recommended_replicas"] == 3  # load alone
    time.sleep(1.2)  # the oldest job now waits longer than a bound of 1 s
    aged_settings = settings | {"fleet_max_queue_age_s": 1.0}
    with (
        private_gateway(**aged_settings) as url,
        httpx.Client(base_url=url, headers=auth_headers(operator)) as http,
    ):
        aged = next(
            t for t in http.get("/v1/fleet").json()["tiers"] if t["queue"] == tiers["cold"]["queue"]
        )
        assert aged["oldest_waiting_s"] > 1.0
        assert aged["recommended_replicas"] == 4  # jobs wait too long: one more than now
