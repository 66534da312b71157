"""The gateway's routing view (``gateway.routing.FleetRouter``) against a real Redis: what it
routes on, and when it routes nothing (an old worker alive, a broker of its own)."""

from __future__ import annotations

import asyncio
import json
import time
from collections import Counter
from typing import Any

from redis import Redis
from redis.asyncio import Redis as AsyncRedis

from contracts.keys import WORKERS_INDEX, worker_key
from contracts.queues import Tier, queue_for
from contracts.registry import AdapterRecord
from contracts.routing import worker_queue
from gateway.config import GatewaySettings
from gateway.metrics import GatewayMetrics
from gateway.routing import FleetRouter


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
            return router.route(record.base_model.digest, record.tier, record.digest)
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
            routes.append(router.route(base, record.tier, digest))  # the first copy
            first = routes[-1].worker
            # It holds the adapter now, and is overloaded (8 running of 8).
            announce({first: 8})
            await router.refresh()
            routes.append(router.route(base, record.tier, digest))  # the second copy
            second = routes[-1].worker
            # The second's fetch is not done: its announcement does not show the adapter yet,
            # and it is busier than the third worker.
            announce({first: 8, second: 4}, holders={first})
            await router.refresh()
            routes.append(router.route(base, record.tier, digest))
            # Both copies overloaded, the second still fetching: the cap counts it, so no
            # third copy is placed; the job goes to the shared queue.
            announce({first: 8, second: 8}, holders={first})
            await router.refresh()
            routes.append(router.route(base, record.tier, digest))
            # Once it shows the adapter, it is a holder like the first.
            announce({first: 8, second: 4})
            await router.refresh()
            routes.append(router.route(base, record.tier, digest))
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
    """A refused job (429, 503, its caller gone) leaves no placement, no count against its
    worker and no routing metric: the next job is routed as if it had never been."""
    record = next(iter(published.values()))
    db = str(private_redis.connection_pool.connection_kwargs.get("db"))
    url = infra.redis_url.rsplit("/", 1)[0] + f"/{db}"
    settings = GatewaySettings(redis_url=url)
    base, digest, tier = record.base_model.digest, record.digest, record.tier
    for worker_id in ("h:1:a", "h:2:b"):
        _announce(private_redis, worker_id, base)
    metrics = GatewayMetrics(0)

    def counted(decision: str) -> float:
        return float(metrics.routing.labels(tier.value, decision)._value.get())

    async def go() -> list[Any]:
        redis = AsyncRedis.from_url(url, decode_responses=True)
        router = FleetRouter(redis, settings, metrics)
        seen: list[Any] = []
        try:
            await router.refresh()
            refused = router.route(base, tier, digest)
            assert refused is not None and refused.decision == "placed"
            router.settle(tier, digest, refused, admitted=False)
            seen.append((dict(router._placing), +router._routed, counted("placed")))
            # Two placed on one worker, one refused: the other still holds the placement.
            first = router.route(base, tier, digest)
            second = router.route(base, tier, digest)
            assert first is not None and second is not None and first.worker == second.worker
            router.settle(tier, digest, first, admitted=True)
            router.settle(tier, digest, second, admitted=False)
            seen.append((set(router._placing.get(digest, {})), +router._routed, counted("placed")))
            seen.append(first.worker)
        finally:
            await redis.aclose()
        return seen

    after_refusal, after_one_of_two, worker = asyncio.run(go())
    assert after_refusal == ({}, Counter(), 0.0)
    assert after_one_of_two == ({worker}, Counter({worker: 1}), 1.0)
