"""Callback URLs at submission: refuse any that could reach inside the network (SSRF), and
report how a delivery is going. (The deliverer checks the address again when it connects.)"""

from __future__ import annotations

import asyncio
import ipaddress
import socket
from datetime import UTC, datetime

from redis.asyncio import Redis

from contracts.errors import ErrorCode
from contracts.keys import webhook_event_key
from contracts.webhooks import (
    DeliveryState,
    IPAddress,
    UrlRefusal,
    WebhookStatus,
    WebhookTarget,
    address_refusal,
    split_url,
)
from gateway.config import GatewaySettings
from gateway.errors import ApiError


async def resolve(host: str, port: int) -> list[IPAddress]:
    """Every address ``host`` resolves to (the event loop's resolver)."""
    infos = await asyncio.get_running_loop().getaddrinfo(host, port, type=socket.SOCK_STREAM)
    return [ipaddress.ip_address(str(info[4][0]).split("%", 1)[0]) for info in infos]


def _forbidden(url: str, why: str, param: str) -> ApiError:
    return ApiError(
        422,
        ErrorCode.WEBHOOK_URL_FORBIDDEN,
        f"Webhook URL {url!r} is not allowed: {why}. Nothing was enqueued.",
        param=param,
    )


async def check_target(
    target: WebhookTarget, settings: GatewaySettings, param: str = "webhook.url"
) -> None:
    """Refuse unless every address the URL's host resolves to is public (or loopback, when
    ``webhook_allow_loopback`` is set for local development)."""
    try:
        _, host, port = split_url(target.url, settings.webhook_allow_http)
    except UrlRefusal as exc:
        raise _forbidden(target.url, str(exc), param) from exc
    try:
        addresses = [ipaddress.ip_address(host)]
    except ValueError:
        try:
            addresses = await resolve(host, port)
        except (OSError, UnicodeError) as exc:  # UnicodeError: a name IDNA can't encode
            raise _forbidden(target.url, f"{host} does not resolve ({exc})", param) from exc
    for ip in addresses:
        reason = address_refusal(ip, settings.webhook_allow_loopback)
        if reason is not None:
            raise _forbidden(target.url, reason, param)


async def delivery_status(redis: Redis, event_id: str) -> WebhookStatus | None:
    """How the event's delivery is going; ``None`` before the event exists."""
    fields: dict[str, str] = await redis.hgetall(webhook_event_key(event_id))  # type: ignore[assignment]
    if not fields:
        return None
    status_code = fields.get("last_status_code")
    return WebhookStatus(
        event_id=event_id,
        url=fields["url"],
        state=DeliveryState(fields["state"]),
        attempts=int(fields.get("attempts") or 0),
        last_status_code=int(status_code) if status_code else None,
        last_error=fields.get("last_error") or None,
        last_attempt_at=_time(fields.get("last_attempt_at")),
        next_attempt_at=_time(fields.get("next_attempt_at")),
        delivered_at=_time(fields.get("delivered_at")),
    )


def _time(value: str | None) -> datetime | None:
    return datetime.fromtimestamp(float(value), tz=UTC) if value else None
