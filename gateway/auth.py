"""Who is calling: a bearer API key resolves to a tenant, or the request is refused (401)."""

from __future__ import annotations

import asyncio
from datetime import UTC, datetime
from typing import Annotated

import sentry_sdk
from fastapi import Depends
from fastapi.security import HTTPAuthorizationCredentials, HTTPBearer
from redis.exceptions import RedisError

from contracts.errors import ErrorCode
from contracts.keys import api_key_key, tenant_key
from contracts.tenants import KEY_PREFIX, ApiKeyRecord, TenantRecord, key_hash
from gateway.deps import RedisDep, SettingsDep
from gateway.errors import ApiError, unavailable

_bearer = HTTPBearer(auto_error=False, description="A tenant API key: `lf_<id>_<secret>`.")

_UNAUTHORIZED = (
    "A valid API key is required: send `Authorization: Bearer <key>` "
    "(create one with `lorafleet tenants create`)."
)


_NOT_AUTHENTICATED = "The request could not be authenticated: {what} ({exc}); retry."


def _refused() -> ApiError:
    return ApiError(
        401, ErrorCode.UNAUTHORIZED, _UNAUTHORIZED, headers={"WWW-Authenticate": "Bearer"}
    )


async def authenticate(
    redis: RedisDep,
    settings: SettingsDep,
    credentials: Annotated[HTTPAuthorizationCredentials | None, Depends(_bearer)],
) -> TenantRecord:
    """The tenant owning the presented key. A revoked key is gone from Redis, so it is
    refused on the next request; a rotated key is refused once its grace period ends."""
    if credentials is None or not credentials.credentials.startswith(KEY_PREFIX):
        raise _refused()
    try:
        async with asyncio.timeout(settings.redis_timeout_s):
            raw_key = await redis.get(api_key_key(key_hash(credentials.credentials)))
            if raw_key is None:
                raise _refused()
            key = ApiKeyRecord.model_validate_json(raw_key)
            raw_tenant = await redis.get(tenant_key(key.tenant))
    except (RedisError, OSError, TimeoutError) as exc:
        raise unavailable("the key store is unreachable", exc, _NOT_AUTHENTICATED) from exc
    if key.expires_at is not None and key.expires_at <= datetime.now(tz=UTC):
        raise _refused()
    if raw_tenant is None:
        raise _refused()
    sentry_sdk.set_tag("tenant", key.tenant)
    return TenantRecord.model_validate_json(raw_tenant)


async def operator(tenant: Annotated[TenantRecord, Depends(authenticate)]) -> TenantRecord:
    if not tenant.operator:
        raise ApiError(
            403,
            ErrorCode.FORBIDDEN,
            f"Tenant {tenant.name!r} is not an operator; this endpoint needs an operator key "
            "(`lorafleet tenants create NAME --operator`).",
        )
    return tenant


TenantDep = Annotated[TenantRecord, Depends(authenticate)]
OperatorDep = Annotated[TenantRecord, Depends(operator)]


async def metrics_reader(
    redis: RedisDep,
    settings: SettingsDep,
    credentials: Annotated[HTTPAuthorizationCredentials | None, Depends(_bearer)],
) -> None:
    """``/metrics`` names adapters and shows the load of every tier: an operator key unless
    ``LORAFLEET_METRICS_PUBLIC`` (a scrape from a private network only)."""
    if settings.metrics_public:
        return
    await operator(await authenticate(redis, settings, credentials))


MetricsReaderDep = Annotated[None, Depends(metrics_reader)]
