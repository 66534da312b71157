"""The gateway application factory (``uvicorn gateway.app:create_app --factory``)."""

from __future__ import annotations

from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from typing import Any

from fastapi import FastAPI
from redis.asyncio import Redis

from contracts.redis_policy import async_client, async_options
from contracts.telemetry import sentry_options
from contracts.warm_process import freeze_heap, thaw_heap
from gateway.batches import Batches
from gateway.body_limit import BodyLimit
from gateway.config import GatewaySettings, get_settings
from gateway.error_scope import ErrorScope
from gateway.errors import install_error_handlers
from gateway.files import Files
from gateway.json_bodies import StrictJsonBodies
from gateway.metrics import GatewayMetrics
from gateway.models import BaseModels
from gateway.popularity import PopularityCounter
from gateway.queue import JobQueues
from gateway.result_store import ResultReader
from gateway.routes import batches, files, fleet, health, jobs, openai
from gateway.routing import FleetRouter
from gateway.streams import StreamHub, reader_client
from gateway.submit import Submitter
from gateway.waiter import JobWaiter


def create_app(settings: GatewaySettings | None = None) -> FastAPI:
    """Build the app; state (Redis pool, queues, waiter) lives for the app's lifespan."""
    settings = settings or get_settings()

    if settings.sentry_dsn:
        import sentry_sdk

        sentry_sdk.init(dsn=settings.sentry_dsn, **sentry_options())

    @asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        app.state.settings = settings
        # A burst of requests waits its turn for a free connection, within its own bound.
        app.state.redis = async_client(
            settings.redis_url,
            settings.redis_max_connections,
            pool_timeout_s=settings.request_timeout_s,
            socket_timeout=settings.redis_timeout_s,
            socket_connect_timeout=settings.redis_timeout_s,
            decode_responses=True,
        )
        queues = JobQueues(settings)
        app.state.models = BaseModels(app.state.redis)
        app.state.metrics = GatewayMetrics(settings.metrics_top_adapters)
        app.state.router = FleetRouter(app.state.redis, settings, app.state.metrics)
        app.state.router.start()
        app.state.popularity = PopularityCounter(app.state.redis, settings.popularity_top_k)
        app.state.popularity.start()
        app.state.submitter = Submitter(
            app.state.redis,
            queues,
            app.state.models,
            app.state.metrics,
            settings,
            app.state.router,
            app.state.popularity,
        )
        app.state.results = ResultReader(settings, budget_s=settings.request_timeout_s)
        app.state.batches = Batches(
            app.state.redis, app.state.submitter, settings, app.state.results
        )
        app.state.files = Files(app.state.redis, app.state.batches, settings)
        # The subscription idles for long stretches: no socket timeout on its connection
        # (nor on the stream reader's, which blocks: ``streams.reader_client``).
        events = Redis.from_url(
            settings.redis_url,
            socket_connect_timeout=settings.redis_timeout_s,
            health_check_interval=30,
            decode_responses=True,
            **async_options(),
        )
        reader = reader_client(settings.redis_url, settings.redis_timeout_s)
        app.state.waiter = JobWaiter(events)
        app.state.waiter.start()
        app.state.streams = StreamHub(reader, app.state.redis, app.state.waiter)
        app.state.streams.start()
        # Started: what lives as long as the app is alive now (``contracts.warm_process``).
        app.state.metrics.heap_frozen.set(freeze_heap())
        try:
            yield
        finally:
            app.state.results.close()  # first: nothing below can then skip it
            thaw_heap()
            await app.state.streams.stop()
            await app.state.waiter.stop()
            await app.state.router.stop()
            await app.state.popularity.stop()
            await reader.aclose()
            await events.aclose()
            await app.state.redis.aclose()
            await queues.close()
            app.state.submitter.close()

    # A body without a Content-Type is read as JSON, as ``StrictJsonBodies`` checks it (FastAPI
    # 0.13x otherwise leaves it unparsed and a valid job is refused as "not an object").
    app = FastAPI(
        title="lorafleet gateway", version="0.1.0", lifespan=lifespan, strict_content_type=False
    )
    install_error_handlers(app)
    # Read by the HTTP protocol (``gateway.http_protocol``) as each connection opens.
    app.state.head_timeout_s = settings.head_timeout_s
    # Added first, so it runs inside the body limit: it only ever buffers a bounded body.
    app.add_middleware(StrictJsonBodies)
    app.add_middleware(
        BodyLimit,
        max_bytes=settings.max_body_bytes,
        timeout_s=settings.body_timeout_s,
        larger={"/v1/batches": settings.max_batch_bytes, "/v1/files": settings.max_batch_bytes},
    )
    if settings.sentry_dsn:
        # Outermost: a request's error reports carry its own tags (``gateway.error_scope``).
        app.add_middleware(ErrorScope)
    app.include_router(health.router)
    app.include_router(jobs.router)
    app.include_router(openai.router)
    app.include_router(batches.router)
    app.include_router(files.router)
    app.include_router(fleet.router)
    generate = app.openapi

    def openapi() -> dict[str, Any]:
        if app.openapi_schema is not None:
            return app.openapi_schema
        document = generate()  # kept as ``app.openapi_schema``
        schemas = document.setdefault("components", {}).setdefault("schemas", {})
        for name, schema in batches.body_schemas().items():
            schemas.setdefault(name, schema)
        return document

    app.openapi = openapi  # type: ignore[method-assign]
    return app
