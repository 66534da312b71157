"""The job API over HTTP against the running gateway and real Redis."""

from __future__ import annotations

import socket

import httpx
import pytest
from fastapi.testclient import TestClient
from redis import Redis

from contracts.queues import queue_for
from contracts.registry import AdapterRecord
from gateway.app import create_app
from gateway.config import GatewaySettings
from tests.helpers import job_records


def _job_keys(redis: Redis) -> int:
    return job_records(redis)


def test_health_and_readiness(gateway_url: str) -> None:
    assert httpx.get(f"{gateway_url}/healthz").json() == {"status": "ok"}
    assert httpx.get(f"{gateway_url}/readyz").json() == {"status": "ready"}


def test_accepted_job_names_revision_and_tier_queue(
    api: httpx.Client, published: dict[str, AdapterRecord]
) -> None:
    record = next(r for r in published.values() if r.tier == "warm")
    response = api.post("/v1/jobs", json={"adapter": record.alias, "prompt": "hello"})
    assert response.status_code == 202
    body = response.json()
    assert body["revision"] == record.digest
    pool = record.base_model.digest.removeprefix("sha256:")[:12]
    assert (
        body["queue"]
        == queue_for(record.tier, record.base_model.digest)
        == f"lorafleet.warm.{pool}"
    )
    assert body["status"] == "queued"
    assert response.headers["location"] == f"/v1/jobs/{body['id']}"
    status = api.get(f"/v1/jobs/{body['id']}").json()
    assert status["id"] == body["id"] and status["revision"] == record.digest


def test_unknown_adapter_is_404_and_enqueues_nothing(api: httpx.Client, redis: Redis) -> None:
    before = _job_keys(redis)
    response = api.post("/v1/jobs", json={"adapter": "no-such", "prompt": "hi"})
    assert response.status_code == 404
    error = response.json()["error"]
    assert error["code"] == "adapter_not_found" and error["param"] == "adapter"
    assert "no-such" in error["message"]
    assert _job_keys(redis) == before


@pytest.mark.parametrize(
    ("body", "field"),
    [
        ({"adapter": "lora-00-r8-qv"}, "prompt"),
        ({"adapter": "lora-00-r8-qv", "prompt": ""}, "prompt"),
        ({"adapter": "../etc/passwd", "prompt": "x"}, "adapter"),
        (
            {"adapter": "lora-00-r8-qv", "prompt": "x", "sampling": {"temperature": 9}},
            "sampling.temperature",
        ),
        (
            {"adapter": "lora-00-r8-qv", "prompt": "x", "sampling": {"max_tokens": 0}},
            "sampling.max_tokens",
        ),
        ({"adapter": "lora-00-r8-qv", "prompt": "x", "sampling": {"stop": [""]}}, "sampling.stop"),
        ({"adapter": "lora-00-r8-qv", "prompt": "x", "surprise": 1}, "surprise"),
    ],
)
def test_invalid_body_is_422_with_field_and_enqueues_nothing(
    api: httpx.Client,
    redis: Redis,
    published: dict[str, AdapterRecord],
    body: dict[str, object],
    field: str,
) -> None:
    before = _job_keys(redis)
    response = api.post("/v1/jobs", json=body)
    assert response.status_code == 422
    error = response.json()["error"]
    assert error["code"] == "validation_error"
    assert field in error["message"]
    assert any(detail["field"] == field for detail in error["details"])
    assert _job_keys(redis) == before


def test_malformed_json_is_422(api: httpx.Client) -> None:
    response = api.post(
        "/v1/jobs", content=b"{not json", headers={"content-type": "application/json"}
    )
    assert response.status_code == 422
    assert response.json()["error"]["code"] == "validation_error"


def test_unknown_job_is_404(api: httpx.Client) -> None:
    response = api.get("/v1/jobs/0123456789abcdef")
    assert response.status_code == 404
    assert response.json()["error"]["code"] == "job_not_found"


def _closed_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port: int = sock.getsockname()[1]
    return port


def test_redis_down_is_503_quickly_with_retry_after() -> None:
    url = f"redis://127.0.0.1:{_closed_port()}/0"
    settings = GatewaySettings(redis_url=url, redis_timeout_s=1.0)
    # No Redis to create a tenant in: a well-formed key the gateway cannot look up either.
    headers = {"Authorization": "Bearer lf_redisdown_0123456789abcdef"}
    with TestClient(create_app(settings), headers=headers) as client:
        response = client.post("/v1/jobs", json={"adapter": "lora-00-r8-qv", "prompt": "hi"})
        assert response.status_code == 503
        assert response.json()["error"]["code"] == "service_unavailable"
        assert "Retry-After" in response.headers
        assert client.get("/readyz").status_code == 503
        status = client.get("/v1/jobs/0123456789abcdef")
        assert status.status_code == 503
        assert status.json()["error"]["code"] == "service_unavailable"
        assert "could not be authenticated" in status.json()["error"]["message"]


def test_long_poll_answers_when_the_job_finishes(
    api: httpx.Client, published: dict[str, AdapterRecord]
) -> None:
    accepted = api.post(
        "/v1/jobs",
        json={"adapter": "lora-00-r8-qv", "prompt": "hello", "sampling": {"max_tokens": 4}},
    ).json()
    response = api.get(f"/v1/jobs/{accepted['id']}", params={"wait_s": 60}, timeout=90)
    assert response.status_code == 200
    assert response.json()["status"] == "succeeded"


def test_long_poll_bounds_and_unknown_jobs(api: httpx.Client) -> None:
    too_long = api.get("/v1/jobs/abc", params={"wait_s": 61})
    assert too_long.status_code == 422
    assert too_long.json()["error"]["code"] == "validation_error"
    unknown = api.get("/v1/jobs/abc", params={"wait_s": 30}, timeout=5)
    assert unknown.status_code == 404
