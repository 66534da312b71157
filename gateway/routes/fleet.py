"""``/v1/fleet``: per pool queue, workers and recommended replicas (operator keys only)."""

from __future__ import annotations

from fastapi import APIRouter
from redis.exceptions import RedisError

from contracts.errors import ErrorCode
from gateway.auth import OperatorDep
from gateway.deps import RedisDep, SettingsDep
from gateway.errors import AUTHENTICATED, responses, unavailable
from gateway.fleet import Fleet, fleet

router = APIRouter(prefix="/v1/fleet", tags=["fleet"])


@router.get("", response_model=Fleet, responses=responses(*AUTHENTICATED, ErrorCode.FORBIDDEN))
async def get_fleet(_: OperatorDep, redis: RedisDep, settings: SettingsDep) -> Fleet:
    """Each pool queue's depth (a tier of one base model's pool), admitted jobs, oldest
    waiting job, live workers (with their resident adapters and free slots) and a
    recommended replica count (formula included)."""
    try:
        return await fleet(redis, settings)
    except (RedisError, OSError) as exc:
        raise unavailable(
            "Redis is unreachable", exc, "The fleet could not be read: {what} ({exc}); retry."
        ) from exc
