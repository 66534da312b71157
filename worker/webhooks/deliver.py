"""One delivery attempt of one webhook event: build the body, sign it, POST it safely, and
decide what happens next. A plain class: the Celery task is a thin shell around it."""

from __future__ import annotations

import email.utils
import ipaddress
import json
import logging
import random
import socket
import threading
import time
from collections.abc import Callable
from datetime import UTC, datetime

import httpx
from botocore.exceptions import BotoCoreError, ClientError
from redis import Redis

from contracts.batches import batch_public
from contracts.job_records import RECORD_FIELDS, job_of
from contracts.keys import batch_key, job_key, webhook_secrets_key
from contracts.storage import StoredResultDamaged, gone_or_denied, stored_result
from contracts.webhooks import (
    DeliveryState,
    IPAddress,
    SigningSecret,
    SigningSecrets,
    UrlRefusal,
    address_refusal,
    headers,
    new_secret,
    split_url,
)
from worker.result_store import ResultStore, results_client
from worker.webhooks.config import WebhookSettings
from worker.webhooks.schedule import Conclusion, Event

log = logging.getLogger(__name__)

Resolver = Callable[[str, int], list[IPAddress]]


def system_resolver(host: str, port: int) -> list[IPAddress]:
    """Every address ``host`` resolves to, in the resolver's order."""
    found: list[IPAddress] = []
    for *_, sockaddr in socket.getaddrinfo(host, port, type=socket.SOCK_STREAM):
        ip = ipaddress.ip_address(str(sockaddr[0]).split("%", 1)[0])
        if ip not in found:
            found.append(ip)
    return found


class Refused(Exception):
    """The callback must not be made (its address is forbidden); never retried."""


def _retry_after_s(value: str | None) -> float | None:
    if not value:
        return None
    if value.strip().isdigit():
        return float(value.strip())
    try:
        when = email.utils.parsedate_to_datetime(value)
    except (TypeError, ValueError):
        return None
    return max(0.0, (when - datetime.now(tz=UTC)).total_seconds())


def _for_good(exc: Exception) -> bool:
    """Whether reading a stored result failed in a way asking again cannot mend."""
    if isinstance(exc, StoredResultDamaged):
        return True
    if isinstance(exc, ClientError):
        return gone_or_denied(dict(exc.response))
    return False


class Deliverer:
    def __init__(
        self,
        redis: Redis,
        settings: WebhookSettings,
        resolver: Resolver = system_resolver,
        results: ResultStore | None = None,
    ) -> None:
        self._redis = redis
        self._settings = settings
        self._resolver = resolver
        self._results = results
        self._results_lock = threading.Lock()
        self._http = httpx.Client(
            follow_redirects=False, timeout=settings.webhook_timeout_s, trust_env=False
        )

    def close(self) -> None:
        self._http.close()

    def attempt(self, event: Event) -> Conclusion:
        """POST ``event`` once; what the schedule should do next."""
        try:
            body = self._payload(event)
        except (BotoCoreError, ClientError, StoredResultDamaged) as exc:
            why = f"the job's result could not be read from the object store: {exc}"
            if _for_good(exc):  # gone, unreadable to us, or not the bytes named
                return Conclusion(DeliveryState.DEAD, None, why)
            # Ours, not the receiver's: try again later, within the event's window.
            return self._retry(event, None, why, None)
        if body is None:
            gone = f"the {event.kind} record has expired or was withdrawn"
            return Conclusion(DeliveryState.DEAD, None, gone)
        now = time.time()
        signed = headers(self._secrets(event.tenant, now), event.event_id, int(now), body)
        try:
            status, retry_after = self._post(event.url, body, signed)
        except Refused as exc:
            return Conclusion(DeliveryState.DEAD, None, f"refused: {exc}")
        except httpx.HTTPError as exc:
            return self._retry(event, None, f"{type(exc).__name__}: {exc}", None)
        if 200 <= status < 300:
            return Conclusion(DeliveryState.DELIVERED, status, None, delivered_at=time.time())
        if status == 410:
            return Conclusion(DeliveryState.DEAD, status, "the receiver answered 410 Gone")
        if status == 429 or status >= 500:
            return self._retry(event, status, f"HTTP {status}", retry_after)
        return Conclusion(DeliveryState.DEAD, status, f"HTTP {status}: not retried")

    def _retry(
        self, event: Event, status: int | None, error: str, retry_after: float | None
    ) -> Conclusion:
        settings = self._settings
        attempts = event.attempts + 1
        if retry_after is not None:
            delay = min(retry_after, settings.webhook_backoff_max_s)
        else:
            exponential = settings.webhook_backoff_s * 2 ** (attempts - 1)
            # Equal jitter: receivers coming back are not hit by every sender at once.
            delay = min(exponential, settings.webhook_backoff_max_s) * random.uniform(0.5, 1.0)
        # One clock reading for both: the recorded gap is the delay chosen, however long this
        # thread is descheduled between two readings.
        now = time.time()
        next_at = now + delay
        if next_at > event.created_at + settings.webhook_retry_window_s:
            spent = f"{error}; retry window {settings.webhook_retry_window_s:g} s spent"
            return Conclusion(DeliveryState.DEAD, status, spent, attempted_at=now)
        return Conclusion(
            DeliveryState.PENDING, status, error, next_attempt_at=next_at, attempted_at=now
        )

    def _payload(self, event: Event) -> bytes | None:
        if event.kind == "batch":
            fields: dict[str, str] = self._redis.hgetall(batch_key(event.subject))  # type: ignore[assignment]
            if "record" not in fields:  # gone, or withdrawn (a tombstone: no record)
                return None
            data = batch_public(fields).model_dump(mode="json")
            kind = "batch.completed"
        else:
            job = job_of(self._redis.hmget(job_key(event.subject), RECORD_FIELDS))  # type: ignore[arg-type]
            if job is None:
                return None
            if stored_result(job) is not None:
                job = self._result_store().read(job)
            data = job.model_dump(mode="json", exclude={"webhook_delivery"})
            kind = f"job.{job.status.value}"
        envelope = {
            "type": kind,
            "timestamp": datetime.fromtimestamp(event.created_at, tz=UTC).isoformat(),
            "data": data,
        }
        return json.dumps(envelope, separators=(",", ":")).encode()

    def _result_store(self) -> ResultStore:
        with self._results_lock:  # one deliverer serves every delivery thread
            if self._results is None:  # built when a first event needs it
                settings = self._settings
                # The results client gives up within seconds: a read that stalled past the
                # event's lease would let the event be dispatched again, and POSTed twice.
                self._results = ResultStore(results_client(settings), settings.s3_bucket, 0)
            return self._results

    def _secrets(self, tenant: str, now: float) -> list[str]:
        key = webhook_secrets_key(tenant)
        raw = self._redis.get(key)
        if raw is None:
            # First event of this tenant: make its secret (the CLI shows it from then on).
            fresh = SigningSecrets(secrets=[SigningSecret(secret=new_secret())])
            self._redis.set(key, fresh.model_dump_json(), nx=True)
            raw = self._redis.get(key)
        return SigningSecrets.model_validate_json(str(raw)).live(now)

    def _address(self, host: str, port: int) -> IPAddress:
        """The first address of ``host`` that may be connected to, checked now (a host that
        resolved to a public address at submission may resolve elsewhere by now)."""
        try:
            literal: IPAddress | None = ipaddress.ip_address(host)
        except ValueError:
            literal = None
        try:
            candidates = [literal] if literal is not None else self._resolver(host, port)
        except OSError as exc:
            raise httpx.ConnectError(f"{host} does not resolve: {exc}") from exc
        reasons = []
        for ip in candidates:
            reason = address_refusal(ip, self._settings.webhook_allow_loopback)
            if reason is None:
                return ip
            reasons.append(reason)
        raise Refused(f"{host}: " + "; ".join(reasons))

    def _post(self, url: str, body: bytes, signed: dict[str, str]) -> tuple[int, float | None]:
        """POST to the checked address itself (Host header and TLS name stay the URL's);
        reads at most ``webhook_max_response_bytes`` of the answer."""
        try:
            scheme, host, port = split_url(url, self._settings.webhook_allow_http)
        except UrlRefusal as exc:
            raise Refused(str(exc)) from exc
        ip = self._address(host, port)
        target = httpx.URL(url).copy_with(host=str(ip))
        default = (scheme == "https" and port == 443) or (scheme == "http" and port == 80)
        request_headers = {**signed, "host": host if default else f"{host}:{port}"}
        deadline = time.monotonic() + self._settings.webhook_timeout_s
        with self._http.stream(
            "POST",
            target,
            content=body,
            headers=request_headers,
            extensions={"sni_hostname": host},
        ) as response:
            read = 0
            for chunk in response.iter_raw():
                read += len(chunk)
                if read >= self._settings.webhook_max_response_bytes:
                    break
                if time.monotonic() > deadline:
                    raise httpx.ReadTimeout("the receiver answered too slowly")
            return response.status_code, _retry_after_s(response.headers.get("retry-after"))
