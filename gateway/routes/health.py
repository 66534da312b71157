"""Liveness and readiness probes (no authentication), and the metrics (an operator key)."""

from __future__ import annotations

from fastapi import APIRouter, Response
from prometheus_client import CONTENT_TYPE_LATEST
from redis.exceptions import RedisError

from contracts.errors import ErrorCode
from gateway.auth import MetricsReaderDep
from gateway.deps import MetricsDep, RedisDep
from gateway.errors import AUTHENTICATED, ApiError, responses

router = APIRouter(tags=["health"])


def _redis_unreachable(exc: Exception) -> ApiError:
    return ApiError(
        503,
        ErrorCode.SERVICE_UNAVAILABLE,
        f"Redis is unreachable: {exc}",
        headers={"Retry-After": "1"},
    )


@router.get("/healthz")
async def healthz() -> dict[str, str]:
    """The process is up and serving HTTP."""
    return {"status": "ok"}


@router.get(
    "/metrics",
    response_class=Response,
    responses=responses(*AUTHENTICATED, ErrorCode.FORBIDDEN),
)
async def metrics(redis: RedisDep, gateway_metrics: MetricsDep, _: MetricsReaderDep) -> Response:
    """Prometheus text format; an operator key, unless ``LORAFLEET_METRICS_PUBLIC``."""
    try:
        body = await gateway_metrics.render(redis)
    except (RedisError, OSError) as exc:
        raise _redis_unreachable(exc) from exc
    return Response(body, media_type=CONTENT_TYPE_LATEST)


@router.get("/readyz")
async def readyz(redis: RedisDep) -> dict[str, str]:
    """Ready to admit jobs: Redis answers within the configured timeout."""
    try:
        await redis.ping()
    except (RedisError, OSError) as exc:
        raise _redis_unreachable(exc) from exc
    return {"status": "ready"}
