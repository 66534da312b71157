"""FastAPI dependencies for who is calling: the presented key (``caller``), its tenant
(``authenticate``, one round trip: ``gateway.access``), operators only (``operator``), and
for the routes that admit a job, the tenant with the adapter its body names resolved
(``JobAccessDep``, ``ModelAccessDep``: the same one round trip, or none when this process
read it before: ``gateway.access.recall``, checked by the admission)."""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable
from typing import Annotated

from fastapi import Depends, Request
from fastapi.security import HTTPAuthorizationCredentials, HTTPBearer
from redis.exceptions import RedisError

from contracts.errors import ErrorCode
from contracts.tenants import KEY_PREFIX, TenantRecord, key_hash
from gateway.access import NOT_AUTHENTICATED, Access, Caller, check, recall, refused
from gateway.deps import RedisDep, SettingsDep
from gateway.errors import UNCONFIRMED, ApiError, unavailable
from gateway.json_bodies import PARSED

_bearer = HTTPBearer(auto_error=False, description="A tenant API key: `lf_<id>_<secret>`.")


async def caller(
    credentials: Annotated[HTTPAuthorizationCredentials | None, Depends(_bearer)],
) -> Caller:
    """The presented key; 401 if there is none or it is not shaped like ours."""
    if credentials is None or not credentials.credentials.startswith(KEY_PREFIX):
        raise refused()
    return Caller(key_hash(credentials.credentials))


CallerDep = Annotated[Caller, Depends(caller)]


async def authenticate(
    redis: RedisDep, settings: SettingsDep, presented: CallerDep
) -> TenantRecord:
    """The tenant owning the presented key (``check`` without a name), within the Redis
    bound: 503 when the key store does not answer."""
    try:
        async with asyncio.timeout(settings.request_timeout_s):
            return (await check(redis, presented)).tenant
    except (RedisError, OSError, TimeoutError) as exc:
        raise unavailable("the key store is unreachable", exc, NOT_AUTHENTICATED) from exc


def _access_to(field: str) -> Callable[..., Awaitable[Access]]:
    async def admission_access(
        request: Request, redis: RedisDep, settings: SettingsDep, presented: CallerDep
    ) -> Access:
        # Dependencies run before FastAPI validates the body: a bad key is 401 whatever the
        # body holds. The name comes from the body as the strict-JSON middleware parsed it
        # (a body FastAPI then refuses answers 422, whatever was resolved here). An access
        # recalled, not read, is confirmed before a client error is answered (``UNCONFIRMED``,
        # read by the error handlers; ``Submitter.submit`` for its own) unless its admission
        # checked it first.
        body = request.scope.get("state", {}).get(PARSED)
        name = body.get(field) if isinstance(body, dict) else None
        try:
            if not isinstance(name, str) or not name:
                async with asyncio.timeout(settings.request_timeout_s):
                    return await check(redis, presented)
            access = await recall(redis, presented, name, settings.request_timeout_s)
        except (RedisError, OSError, TimeoutError) as exc:
            raise unavailable("the key store is unreachable", exc, NOT_AUTHENTICATED) from exc
        if access.unconfirmed is not None:
            setattr(request.state, UNCONFIRMED, access.unconfirmed)
        return access

    return admission_access


JobAccessDep = Annotated[Access, Depends(_access_to("adapter"))]
"""``POST /v1/jobs``: the caller's tenant, and the body's ``adapter`` resolved for it."""
ModelAccessDep = Annotated[Access, Depends(_access_to("model"))]
"""The OpenAI endpoints: the caller's tenant, and the body's ``model`` resolved for it."""


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
    await operator(await authenticate(redis, settings, await caller(credentials)))


MetricsReaderDep = Annotated[None, Depends(metrics_reader)]
