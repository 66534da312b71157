"""Webhook callbacks end to end: the stack's webhook worker calls a real receiver, signed per
Standard Webhooks (verified with the independent ``standardwebhooks`` library)."""

from __future__ import annotations

import json
import time
from datetime import datetime
from typing import Any

import httpx
import pytest
from redis import Redis
from standardwebhooks.webhooks import Webhook, WebhookVerificationError

from contracts.keys import webhook_event_key
from contracts.registry import AdapterRecord
from contracts.webhooks import job_event_id
from lorafleet.tenants import Tenants
from tests.helpers import hot_alias
from tests.receiver import Call, Receiver, receiving

SHORT = {"max_tokens": 4, "temperature": 0.0}
BACKOFF_S = 0.4  # LORAFLEET_WEBHOOK_BACKOFF_S of the session stack


def _submit(api: httpx.Client, adapter: str, url: str) -> str:
    body = {"adapter": adapter, "prompt": "hello", "sampling": SHORT, "webhook": {"url": url}}
    response = api.post("/v1/jobs", json=body)
    assert response.status_code == 202, response.text
    job_id: str = response.json()["id"]
    return job_id


def _delivery(api: httpx.Client, job_id: str, until: Any, timeout_s: float = 60) -> dict[str, Any]:
    deadline = time.monotonic() + timeout_s
    while True:
        job = api.get(f"/v1/jobs/{job_id}", params={"wait_s": 10}).json()
        delivery = job.get("webhook_delivery")
        if delivery is not None and until(delivery):
            return dict(delivery)
        assert time.monotonic() < deadline, f"delivery never matched: {delivery}"
        time.sleep(0.05)


def _verify(secret: str, call: Call) -> dict[str, Any]:
    payload: dict[str, Any] = Webhook(secret).verify(call.body, call.headers)
    return payload


def test_job_webhook_is_signed_and_carries_the_job(
    api: httpx.Client, redis: Redis, published: dict[str, AdapterRecord]
) -> None:
    secret = Tenants(redis).webhook_secrets("dev").secrets[0].secret
    with receiving() as receiver:
        job_id = _submit(api, hot_alias(published), receiver.url())
        (call,) = receiver.wait_for(job_event_id(job_id))
    payload = _verify(secret, call)
    assert payload["type"] == "job.succeeded"
    assert payload["data"]["id"] == job_id and payload["data"]["status"] == "succeeded"
    assert payload["data"]["metadata"]["identity_verified"] is True
    assert payload["data"]["result"]["usage"]["completion_tokens"] == 4
    assert call.path == "/hook"
    delivery = _delivery(api, job_id, lambda d: d["state"] == "delivered")
    assert delivery["attempts"] == 1 and delivery["last_status_code"] == 200
    with pytest.raises(WebhookVerificationError):
        Webhook("whsec_" + "A" * 32).verify(call.body, call.headers)


def test_rotation_signs_with_both_secrets_until_the_grace_ends(
    api: httpx.Client, redis: Redis, published: dict[str, AdapterRecord]
) -> None:
    tenants = Tenants(redis)
    old = tenants.webhook_secrets("dev").secrets[0].secret
    new = tenants.webhook_secrets("dev", rotate=True, grace_s=3600).secrets[0].secret
    assert new != old
    with receiving() as receiver:
        job_id = _submit(api, hot_alias(published), receiver.url())
        (during,) = receiver.wait_for(job_event_id(job_id))
        assert len(during.headers["webhook-signature"].split()) == 2
        assert _verify(old, during)["data"]["id"] == job_id
        assert _verify(new, during)["data"]["id"] == job_id

        newest = tenants.webhook_secrets("dev", rotate=True, grace_s=0).secrets
        assert len(newest) == 1
        job_id = _submit(api, hot_alias(published), receiver.url())
        (after,) = receiver.wait_for(job_event_id(job_id))
    assert _verify(newest[0].secret, after)["data"]["id"] == job_id
    for retired in (old, new):
        with pytest.raises(WebhookVerificationError):
            _verify(retired, after)


def test_receiver_down_then_up_gets_the_event_once_with_the_same_id(
    api: httpx.Client, redis: Redis, published: dict[str, AdapterRecord]
) -> None:
    receiver = Receiver()  # not listening yet: connections are refused
    job_id = _submit(api, hot_alias(published), receiver.url())
    event = job_event_id(job_id)
    delays = {}
    deadline = time.monotonic() + 60
    while len(delays) < 3:  # watch the schedule of the first retries
        fields: dict[str, str] = redis.hgetall(webhook_event_key(event))  # type: ignore[assignment]
        if fields.get("next_attempt_at") and fields.get("last_attempt_at"):
            attempt = int(fields["attempts"])
            delays[attempt] = float(fields["next_attempt_at"]) - float(fields["last_attempt_at"])
            assert fields["state"] == "pending"
            assert "ConnectError" in fields["last_error"]
        assert time.monotonic() < deadline, f"retries stalled at {fields}"
        time.sleep(0.01)
    for attempt, delay in delays.items():
        # Exponential with equal jitter: between half and all of backoff * 2^(attempt - 1).
        full = BACKOFF_S * 2 ** (attempt - 1)
        assert full / 2 - 0.01 <= delay <= full + 0.01, (attempt, delay)

    receiver.start()
    try:
        (call,) = receiver.wait_for(event)
        delivery = _delivery(api, job_id, lambda d: d["state"] == "delivered")
        assert delivery["attempts"] >= 4
        assert call.headers["webhook-id"] == event
        time.sleep(2)  # many dispatcher rounds: a delivered event is never sent again
        assert len(receiver.calls_for(event)) == 1
    finally:
        receiver.stop()


def test_429_retry_after_is_honoured_410_and_redirects_stop_retries(
    api: httpx.Client, published: dict[str, AdapterRecord]
) -> None:
    with receiving(script=[(429, {"Retry-After": "2"})]) as receiver:
        job_id = _submit(api, hot_alias(published), receiver.url())
        retried = _delivery(api, job_id, lambda d: d["attempts"] == 1)
        assert retried["state"] == "pending" and retried["last_status_code"] == 429
        scheduled = _seconds(retried["next_attempt_at"]) - _seconds(retried["last_attempt_at"])
        assert abs(scheduled - 2) < 0.05
        receiver.wait_for(job_event_id(job_id), count=2)
        assert _delivery(api, job_id, lambda d: d["state"] == "delivered")["attempts"] == 2

    for status, headers in [(410, {}), (302, {"Location": "http://127.0.0.1:1/elsewhere"})]:
        with receiving(default=status, script=[(status, headers)]) as receiver:
            job_id = _submit(api, hot_alias(published), receiver.url())
            dead = _delivery(api, job_id, lambda d: d["state"] == "dead")
            assert dead["attempts"] == 1 and dead["last_status_code"] == status
            time.sleep(1)
            assert len(receiver.calls_for(job_event_id(job_id))) == 1


def _seconds(iso: str) -> float:
    return datetime.fromisoformat(iso).timestamp()


def test_webhook_payload_is_the_public_job(
    api: httpx.Client, published: dict[str, AdapterRecord]
) -> None:
    with receiving() as receiver:
        job_id = _submit(api, hot_alias(published), receiver.url())
        (call,) = receiver.wait_for(job_event_id(job_id))
    data = json.loads(call.body)["data"]
    public = api.get(f"/v1/jobs/{job_id}").json()
    public.pop("webhook_delivery")
    assert data == public
