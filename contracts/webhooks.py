"""Webhook callbacks: where a caller may be called back, how a call is signed, what it says.

Signing follows the Standard Webhooks specification: ``webhook-id`` (stable across retries of
one event), ``webhook-timestamp`` (unix seconds of this attempt) and ``webhook-signature``:
space-separated ``v1,<base64 HMAC-SHA256(secret, "{id}.{timestamp}.{body}")>``, one per
live secret (two while a secret rotation's grace period runs).

The address policy refuses callback hosts that resolve to anything but the public internet
(SSRF): loopback, private, link-local, carrier-grade NAT, multicast, unspecified, reserved,
and IPv6 forms embedding such IPv4 addresses (IPv4-mapped, NAT64, 6to4). It is applied when a
job is submitted and again, by the deliverer, to the address it actually connects to.
"""

from __future__ import annotations

import base64
import hashlib
import hmac
import ipaddress
import secrets
from datetime import datetime
from enum import StrEnum
from urllib.parse import urlsplit

from pydantic import BaseModel, ConfigDict, Field

SECRET_PREFIX = "whsec_"
MAX_URL_CHARS = 2048

_NAT64 = (ipaddress.ip_network("64:ff9b::/96"), ipaddress.ip_network("64:ff9b:1::/48"))
_CGNAT = ipaddress.ip_network("100.64.0.0/10")

IPAddress = ipaddress.IPv4Address | ipaddress.IPv6Address


class WebhookTarget(BaseModel):
    """``webhook`` of a job or batch: where to POST its outcome."""

    model_config = ConfigDict(extra="forbid")

    url: str = Field(min_length=1, max_length=MAX_URL_CHARS)


class DeliveryState(StrEnum):
    PENDING = "pending"
    DELIVERED = "delivered"
    DEAD = "dead"


class WebhookStatus(BaseModel):
    """How the callback of one event is going (shown on the job or batch)."""

    event_id: str
    url: str
    state: DeliveryState
    attempts: int = 0
    last_status_code: int | None = None
    last_error: str | None = None
    last_attempt_at: datetime | None = None
    next_attempt_at: datetime | None = None
    delivered_at: datetime | None = None


def job_event_id(job_id: str) -> str:
    """The one event a job's terminal state produces (stable: the ``webhook-id``)."""
    return f"evt_job_{job_id}"


def batch_event_id(batch_id: str) -> str:
    return f"evt_batch_{batch_id}"


class UrlRefusal(Exception):
    """The URL may not be called back; ``str()`` says why, for the caller."""


def _embedded_v4(ip: ipaddress.IPv6Address) -> ipaddress.IPv4Address | None:
    if ip.ipv4_mapped is not None:
        return ip.ipv4_mapped
    if ip.sixtofour is not None:
        return ip.sixtofour
    if any(ip in net for net in _NAT64):
        return ipaddress.IPv4Address(int(ip) & 0xFFFFFFFF)
    return None


def address_refusal(ip: IPAddress, allow_loopback: bool = False) -> str | None:
    """Why ``ip`` may not be connected to, or ``None`` if it is a public address."""
    if isinstance(ip, ipaddress.IPv6Address):
        embedded = _embedded_v4(ip)
        if embedded is not None:
            reason = address_refusal(embedded, allow_loopback)
            return None if reason is None else f"{reason} (embedded in {ip})"
    if ip.is_loopback:
        return None if allow_loopback else f"{ip} is a loopback address"
    checks = (
        (ip.is_unspecified, "an unspecified"),
        (ip.is_multicast, "a multicast"),
        (ip.is_link_local, "a link-local"),
        (isinstance(ip, ipaddress.IPv4Address) and ip in _CGNAT, "a carrier-grade NAT"),
        (ip.is_private, "a private"),
        (ip.is_reserved, "a reserved"),
        (not ip.is_global, "a non-public"),
    )
    for hit, kind in checks:
        if hit:
            return f"{ip} is {kind} address"
    return None


def split_url(url: str, allow_http: bool) -> tuple[str, str, int]:
    """``(scheme, host, port)`` of a callback URL, or ``UrlRefusal``."""
    try:
        parts = urlsplit(url)
        port = parts.port
    except ValueError as exc:
        raise UrlRefusal(f"{url!r} is not a valid URL ({exc})") from exc
    schemes = ("https", "http") if allow_http else ("https",)
    if parts.scheme not in schemes:
        raise UrlRefusal(f"callback URLs must use {' or '.join(schemes)}, not {parts.scheme!r}")
    if not parts.hostname:
        raise UrlRefusal(f"{url!r} names no host")
    if parts.username or parts.password:
        raise UrlRefusal("callback URLs may not carry credentials")
    return parts.scheme, parts.hostname, port or (443 if parts.scheme == "https" else 80)


def new_secret() -> str:
    return SECRET_PREFIX + base64.b64encode(secrets.token_bytes(24)).decode()


def signature(secret: str, event_id: str, timestamp: int, body: bytes) -> str:
    """``v1,<base64 HMAC-SHA256>`` of ``{id}.{timestamp}.{body}`` with ``secret``."""
    key = base64.b64decode(secret.removeprefix(SECRET_PREFIX))
    signed = f"{event_id}.{timestamp}.".encode() + body
    digest = hmac.new(key, signed, hashlib.sha256).digest()
    return "v1," + base64.b64encode(digest).decode()


def headers(secrets_: list[str], event_id: str, timestamp: int, body: bytes) -> dict[str, str]:
    """The Standard Webhooks headers, signed with every live secret."""
    return {
        "webhook-id": event_id,
        "webhook-timestamp": str(timestamp),
        "webhook-signature": " ".join(signature(s, event_id, timestamp, body) for s in secrets_),
        "content-type": "application/json",
    }


class SigningSecret(BaseModel):
    """One of a tenant's signing secrets; a rotated-out one carries its end (unix seconds)."""

    secret: str
    expires_at: float | None = None


class SigningSecrets(BaseModel):
    """A tenant's secrets, newest first (stored as JSON under ``webhook_secrets_key``)."""

    secrets: list[SigningSecret]

    def live(self, now: float) -> list[str]:
        return [s.secret for s in self.secrets if s.expires_at is None or s.expires_at > now]

    def rotated(self, now: float, grace_s: float) -> SigningSecrets:
        """A new current secret; the live old ones end after ``grace_s`` (now if 0)."""
        ending = now + grace_s
        kept = [
            SigningSecret(secret=s.secret, expires_at=min(s.expires_at or ending, ending))
            for s in self.secrets
            if grace_s > 0 and (s.expires_at is None or s.expires_at > now)
        ]
        return SigningSecrets(secrets=[SigningSecret(secret=new_secret()), *kept])
