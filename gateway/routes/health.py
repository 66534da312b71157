"""Liveness and readiness probes (no authentication)."""

from __future__ import annotations

from fastapi import APIRouter
from redis.exceptions import RedisError

from contracts.errors import ErrorCode
from gateway.deps import RedisDep
from gateway.errors import ApiError

router = APIRouter(tags=["health"])


@router.get("/healthz")
async def healthz() -> dict[str, str]:
    """The process is up and serving HTTP."""
    return {"status": "ok"}


@router.get("/readyz")
async def readyz(redis: RedisDep) -> dict[str, str]:
    """Ready to admit jobs: Redis answers within the configured timeout."""
    try:
        await redis.ping()
    except (RedisError, OSError) as exc:
        raise ApiError(
            503,
            ErrorCode.SERVICE_UNAVAILABLE,
            f"Redis is unreachable: {exc}",
            headers={"Retry-After": "1"},
        ) from exc
    return {"status": "ready"}
