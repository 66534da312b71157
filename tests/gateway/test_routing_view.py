"""The gateway's routing view (``gateway.routing.FleetRouter``) against a real Redis: what it
routes on, and when it routes nothing (an old worker alive, a broker of its own)."""

from __future__ import annotations

import asyncio
import json
import time
from collections import Counter
from collections.abc import Callable
from typing import Any

import httpx
from redis import Redis
from redis.asyncio import Redis as AsyncRedis

from contracts.jobs import Routed
from contracts.keys import WORKERS_INDEX, worker_key
from contracts.metrics import ROUTING_DECISIONS
from contracts.queues import Tier, queue_for
from contracts.registry import AdapterRecord
from contracts.routing import worker_queue
from contracts.tenants import TenantLimits
from gateway.config import GatewaySettings
from gateway.metrics import GatewayMetrics
from gateway.routing import FleetRouter
from lorafleet.client import auth_headers
from lorafleet.tenants import Tenants


def _announce(redis: Redis, worker_id: str, base: str, old: bool = False, **extra: Any) -> None:
    record: dict[str, Any] = {
        "worker_id": worker_id,
        "state": "serving",
        "base_model": {"id": "m", "digest": base},
        "queues": [queue_for(tier, base) for tier in Tier],
        "concurrency": 8,
        "jobs_running": 0,
        "max_loras": 4,
        "adapters": {},
        "seen_at": time.time(),
        **extra,
    }
    if not old:
        record["queue"] = worker_queue(worker_id)
    redis.set(worker_key(worker_id), json.dumps(record), ex=60)
    redis.sadd(WORKERS_INDEX, worker_id)


def _routes(url: str, settings: GatewaySettings, record: AdapterRecord) -> Any:
    async def go() -> Any:
        redis = AsyncRedis.from_url(url, decode_responses=True)
        try:
            router = FleetRouter(redis, settings, GatewayMetrics(0))
            await router.refresh()
            return router.route("job", record.base_model.digest, record.tier, record.digest)
        finally:
            await redis.aclose()

    return asyncio.run(go())


def test_the_view_routes_to_live_workers_and_to_none_while_an_old_one_lives(
    private_redis: Redis, published: dict[str, AdapterRecord], infra: Any
) -> None:
    record = next(iter(published.values()))
    url = str(private_redis.connection_pool.connection_kwargs.get("db"))
    url = infra.redis_url.rsplit("/", 1)[0] + f"/{url}"
    settings = GatewaySettings(redis_url=url)
    base = record.base_model.digest
    _announce(private_redis, "h:1:a", base)
    _announce(private_redis, "h:4:c", base)
    _announce(private_redis, "h:2:b", base, adapters={record.digest: "engine"})
    routed = _routes(url, settings, record)
    assert routed is not None and (routed.decision, routed.worker) == ("resident", "h:2:b")
    # Silent for longer than a living worker is: not routed to (a killed one, say).
    _announce(private_redis, "h:2:b", base, adapters={record.digest: "engine"}, seen_at=0)
    routed = _routes(url, settings, record)
    assert routed is not None and routed.decision == "placed"
    assert routed.worker in {"h:1:a", "h:4:c"}
    # A worker of a release without own queues: nothing is routed while it lives.
    _announce(private_redis, "h:3:old", base, old=True)
    assert _routes(url, settings, record) is None
    private_redis.delete(worker_key("h:3:old"))
    assert _routes(url, settings, record) is not None
    # Queues on a broker of their own: not routed (the keepers could not hand them back).
    broker = GatewaySettings(redis_url=url, broker_url=url.rsplit("/", 1)[0] + "/9")
    assert _routes(url, broker, record) is None


def test_a_placement_counts_as_a_copy_before_the_workers_announcement_shows_it(
    private_redis: Redis, published: dict[str, AdapterRecord], infra: Any
) -> None:
    """CI once counted 3 S3 GETs of one adapter with a cap of 2 copies: a placed worker's
    announcement lags its fetch, and a view with the first copy (overloaded) and not yet the
    second placed a third on the idlest worker."""
    record = next(iter(published.values()))
    db = str(private_redis.connection_pool.connection_kwargs.get("db"))
    url = infra.redis_url.rsplit("/", 1)[0] + f"/{db}"
    settings = GatewaySettings(redis_url=url, route_max_copies=2)
    base, digest = record.base_model.digest, record.digest
    workers = ["h:1:a", "h:2:b", "h:3:c"]

    def announce(running: dict[str, int], holders: set[str] | None = None) -> None:
        """Every worker, with its running jobs; ``holders`` (default: those in ``running``)
        show the adapter, on disk."""
        shown = set(running) if holders is None else holders
        for worker_id in workers:
            adapters = {digest: "disk"} if worker_id in shown else {}
            jobs = running.get(worker_id, 0)
            _announce(private_redis, worker_id, base, adapters=adapters, jobs_running=jobs)

    async def go() -> list[Any]:
        redis = AsyncRedis.from_url(url, decode_responses=True)
        router = FleetRouter(redis, settings, GatewayMetrics(0))
        routes = []
        try:
            announce({})
            await router.refresh()
            routes.append(router.route("job-1", base, record.tier, digest))  # the first copy
            first = routes[-1].worker
            # It holds the adapter now, and is overloaded (8 running of 8).
            announce({first: 8})
            await router.refresh()
            routes.append(router.route("job-2", base, record.tier, digest))  # the second copy
            second = routes[-1].worker
            # The second's fetch is not done: its announcement does not show the adapter yet,
            # and it is busier than the third worker.
            announce({first: 8, second: 4}, holders={first})
            await router.refresh()
            routes.append(router.route("job-3", base, record.tier, digest))
            # Both copies overloaded, the second still fetching: the cap counts it, so no
            # third copy is placed; the job goes to the shared queue.
            announce({first: 8, second: 8}, holders={first})
            await router.refresh()
            routes.append(router.route("job-4", base, record.tier, digest))
            # Once it shows the adapter, it is a holder like the first.
            announce({first: 8, second: 4})
            await router.refresh()
            routes.append(router.route("job-5", base, record.tier, digest))
            # And the placements it remembered are forgotten.
            routes.append(getattr(router, "_placing", None))
        finally:
            await redis.aclose()
        return routes

    *routes, placing = asyncio.run(go())
    assert routes[3] is None, routes  # the shared queue: copies at the cap
    del routes[3]
    assert [r.decision for r in routes] == ["placed", "placed", "placed", "resident"], routes
    first, second = routes[0].worker, routes[1].worker
    assert first != second
    assert {r.worker for r in routes} == {first, second}, routes
    assert placing == {}


def test_a_route_whose_job_is_not_admitted_is_taken_back(
    private_redis: Redis, published: dict[str, AdapterRecord], infra: Any
) -> None:
    """A refused job leaves no placement, no count against its worker and no routing metric;
    one whose admission's fate is unknown gives back its count but keeps its placement (the
    copy may be made after all); a late settle touches neither a newer view's counts nor a
    newer placement."""
    record = next(iter(published.values()))
    db = str(private_redis.connection_pool.connection_kwargs.get("db"))
    url = infra.redis_url.rsplit("/", 1)[0] + f"/{db}"
    settings = GatewaySettings(redis_url=url)
    base, digest, tier = record.base_model.digest, record.digest, record.tier
    for worker_id in ("h:1:a", "h:2:b"):
        _announce(private_redis, worker_id, base)
    metrics = GatewayMetrics(0)

    def counted() -> float:
        return sum(
            float(metrics.routing.labels(tier.value, decision)._value.get())
            for decision in ("placed", "resident", "shared")
        )

    async def go() -> dict[str, Any]:
        redis = AsyncRedis.from_url(url, decode_responses=True)
        router = FleetRouter(redis, settings, metrics)
        seen: dict[str, Any] = {}

        def state() -> tuple[Any, ...]:
            placed = {d: set(workers) for d, workers in router._placing.items()}
            return placed, +router._routed, counted()

        def route(job_id: str) -> Routed:
            routed = router.route(job_id, base, tier, digest)
            assert routed is not None and routed.decision == "placed", routed
            return routed

        try:
            await router.refresh()
            refused = route("refused")
            router.settle("refused", tier, refused, admitted=False, refused=True)
            seen["refused"] = state()
            # Two placed on one worker, the second refused: the first still holds it.
            first, second = route("first"), route("second")
            assert first.worker == second.worker
            router.settle("first", tier, first, admitted=True, refused=False)
            router.settle("second", tier, second, admitted=False, refused=True)
            router.settle("second", tier, second, admitted=False, refused=True)  # again: no-op
            seen["one of two"] = state()
            seen["worker"] = first.worker
            # Fate unknown: the count is given back, the placement kept.
            router._placing.clear()
            router._placed_jobs.clear()
            unknown = route("unknown")
            router.settle("unknown", tier, unknown, admitted=False, refused=False)
            seen["unknown"] = state()
            seen["unknown worker"] = unknown.worker
            # Settled after a new read of the fleet and a new placement of the same pair: the
            # new view's count and the new placement stay.
            await router.refresh()  # no counts: both routes below rank the workers alike
            router._placing.clear()
            late = route("late")
            await router.refresh()
            router._placing.clear()
            newer = route("newer")
            assert newer.worker == late.worker
            router.settle("late", tier, late, admitted=False, refused=True)
            seen["late"] = state()
            seen["late worker"] = late.worker
        finally:
            await redis.aclose()
        return seen

    seen = asyncio.run(go())
    worker = seen["worker"]
    assert seen["refused"] == ({}, Counter(), 0.0)
    assert seen["one of two"] == ({digest: {worker}}, Counter({worker: 1}), 1.0)
    # "first"'s count stays (admitted); the unknown one's is given back, its placement kept.
    assert seen["unknown"] == ({digest: {seen["unknown worker"]}}, Counter({worker: 1}), 1.0)
    late = seen["late worker"]
    assert seen["late"] == ({digest: {late}}, Counter({late: 1}), 1.0)


def test_a_job_refused_at_admission_is_not_counted_as_routed(
    private_gateway: Callable[..., Any],
    tenant_key: Callable[..., str],
    private_redis: Redis,
    published: dict[str, AdapterRecord],
) -> None:
    """Through the gateway: of two jobs of a tenant allowed one, the routing metric counts the
    admitted one only (it counted the refused one too: its route was chosen before the
    admission refused it)."""
    record = next(r for r in published.values() if r.tier == Tier.COLD)
    for worker_id in ("h:1:a", "h:2:b"):
        _announce(private_redis, worker_id, record.base_model.digest)
    tenants = Tenants(private_redis)
    _, operator = tenants.create("ops", TenantLimits(max_concurrent=1000), operator=True)
    key = tenant_key("once", rate_per_s=0.001, burst=1)
    job = {"adapter": record.alias, "prompt": "hi"}
    with (
        private_gateway() as url,
        httpx.Client(base_url=url, headers=auth_headers(key), timeout=30) as http,
    ):
        assert http.post("/v1/jobs", json=job).status_code == 202
        refused = http.post("/v1/jobs", json=job)
        assert refused.status_code == 429, refused.text
        metrics = http.get("/metrics", headers=auth_headers(operator))
    assert metrics.status_code == 200, metrics.text
    routed = [
        float(line.rsplit(" ", 1)[1])
        for line in metrics.text.splitlines()
        if line.startswith(ROUTING_DECISIONS + "{")
    ]
    assert sum(routed) == 1.0, routed
