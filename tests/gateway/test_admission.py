"""Admission control through HTTP against a gateway with real Redis: limits are exact under
concurrency, refusals leave nothing behind, and nothing is admitted that was not enqueued."""

from __future__ import annotations

import asyncio
import hashlib
import json
import logging
import socket
import time
from collections.abc import Callable, Iterator
from typing import Any

import httpx
from redis import Redis

from contracts import admission
from contracts.keys import (
    DEADLINES,
    STREAM_OPENED,
    STREAM_OPENED_ID,
    STREAM_TTL_S,
    job_key,
    rate_key,
    reply_channel,
    stream_key,
    tenant_ledger_key,
)
from contracts.queues import Tier
from contracts.registry import AdapterRecord
from lorafleet.client import auth_headers
from lorafleet.stack import LocalStack
from tests.gateway.conftest import PRIVATE_DB
from tests.helpers import job_records, pool_ledger_entries, queued_messages
from tests.sockets import hang, slow_replies, tcp_server


def _cold(published: dict[str, AdapterRecord]) -> str:
    return next(r.alias for r in published.values() if r.tier == Tier.COLD)


def _job(adapter: str, prompt: str = "hello") -> dict[str, Any]:
    return {"adapter": adapter, "prompt": prompt, "sampling": {"max_tokens": 4}}


def _state(redis: Redis, tenant: str) -> dict[str, int]:
    """Everything an admission leaves behind."""
    return {
        "records": job_records(redis),
        "pool_ledgers": pool_ledger_entries(redis),
        "tenant_ledger": int(redis.zcard(tenant_ledger_key(tenant))),  # type: ignore[arg-type]
        "queued": queued_messages(redis),
    }


async def _submit_all(
    url: str,
    key: str,
    bodies: list[dict[str, Any]],
    connections: int = 100,
    **kw: Any,
) -> list[Any]:
    async with httpx.AsyncClient(
        base_url=url,
        headers=auth_headers(key),
        timeout=30,
        limits=httpx.Limits(max_connections=connections),
    ) as http:
        return list(await asyncio.gather(*(http.post("/v1/jobs", json=b, **kw) for b in bodies)))


def test_fifty_concurrent_submissions_against_a_limit_of_twenty_admit_exactly_twenty(
    private_gateway: Callable[..., Any],
    tenant_key: Callable[..., str],
    private_redis: Redis,
    published: dict[str, AdapterRecord],
) -> None:
    key = tenant_key("acme", max_concurrent=20)
    with private_gateway() as url:
        answers = asyncio.run(_submit_all(url, key, [_job(_cold(published))] * 50))
        admitted = [a for a in answers if a.status_code == 202]
        refused = [a for a in answers if a.status_code == 429]
        assert len(admitted) == 20 and len(refused) == 30, [a.status_code for a in answers]
        for answer in refused:
            error = answer.json()["error"]
            assert error["code"] == "tenant_concurrency_exceeded"
            assert "20 unfinished jobs" in error["message"]
            assert int(answer.headers["Retry-After"]) >= 1
        assert _state(private_redis, "acme") == {
            "records": 20,
            "pool_ledgers": 20,
            "tenant_ledger": 20,
            "queued": 20,
        }
        # Every terminal state releases the slot: cancel them all, the ledgers empty.
        with httpx.Client(base_url=url, headers=auth_headers(key)) as http:
            for answer in admitted:
                assert http.delete(f"/v1/jobs/{answer.json()['id']}").status_code == 200
            assert _state(private_redis, "acme")["tenant_ledger"] == 0
            assert _state(private_redis, "acme")["pool_ledgers"] == 0
            assert http.post("/v1/jobs", json=_job(_cold(published))).status_code == 202


def test_tier_limit_refuses_with_its_own_code(
    private_gateway: Callable[..., Any],
    tenant_key: Callable[..., str],
    private_redis: Redis,
    published: dict[str, AdapterRecord],
) -> None:
    key = tenant_key("acme")
    with (
        private_gateway(max_admitted_cold=3) as url,
        httpx.Client(base_url=url, headers=auth_headers(key)) as http,
    ):
        codes = [http.post("/v1/jobs", json=_job(_cold(published))).status_code for _ in range(4)]
        assert codes == [202, 202, 202, 429]
        refused = http.post("/v1/jobs", json=_job(_cold(published)))
        assert refused.json()["error"]["code"] == "tier_limit_exceeded"
        assert "cold tier" in refused.json()["error"]["message"]
        assert refused.headers["Retry-After"] == "1"
        # Another tier has its own budget.
        hot = next(r.alias for r in published.values() if r.tier == Tier.HOT)
        assert http.post("/v1/jobs", json=_job(hot)).status_code == 202
    assert _state(private_redis, "acme")["pool_ledgers"] == 3 + 1


def test_rate_limit_refuses_past_the_burst_with_retry_after(
    private_gateway: Callable[..., Any],
    tenant_key: Callable[..., str],
    private_redis: Redis,
    published: dict[str, AdapterRecord],
) -> None:
    key = tenant_key("acme", rate_per_s=0.2, burst=3)
    with private_gateway() as url, httpx.Client(base_url=url, headers=auth_headers(key)) as http:
        codes = [http.post("/v1/jobs", json=_job(_cold(published))).status_code for _ in range(4)]
        assert codes == [202, 202, 202, 429]
        refused = http.post("/v1/jobs", json=_job(_cold(published)))
        error = refused.json()["error"]
        assert error["code"] == "tenant_rate_exceeded"
        assert "0.2 jobs/s" in error["message"]
        # One token every 5 s: the caller is told to come back within that.
        assert 1 <= int(refused.headers["Retry-After"]) <= 5
    assert _state(private_redis, "acme")["records"] == 3


def test_queue_unreachable_is_503_and_leaves_no_ledger_entry_record_or_token(
    private_gateway: Callable[..., Any],
    tenant_key: Callable[..., str],
    private_redis: Redis,
    published: dict[str, AdapterRecord],
) -> None:
    key = tenant_key("acme", rate_per_s=0.01, burst=2)
    with (
        tcp_server(hang) as (port, _),
        private_gateway(broker_url=f"redis://127.0.0.1:{port}/0", redis_timeout_s=1.0) as url,
        httpx.Client(base_url=url, headers=auth_headers(key), timeout=20) as http,
    ):
        for _ in range(3):  # more than the burst: a refused job gives its token back
            response = http.post("/v1/jobs", json=_job(_cold(published)))
            assert response.status_code == 503, response.text
            assert response.json()["error"]["code"] == "service_unavailable"
            assert "Nothing was enqueued" in response.json()["error"]["message"]
            assert response.headers["Retry-After"] == "2"
    assert _state(private_redis, "acme") == {
        "records": 0,
        "pool_ledgers": 0,
        "tenant_ledger": 0,
        "queued": 0,
    }
    assert float(private_redis.hget(rate_key("acme"), "tokens") or 0) > 1  # type: ignore[arg-type]


def test_admission_whose_reply_outlasts_the_bound_is_503_and_leaves_nothing(
    private_gateway: Callable[..., Any],
    tenant_key: Callable[..., str],
    private_redis: Redis,
    infra: LocalStack,
    published: dict[str, AdapterRecord],
) -> None:
    """The admission script runs in Redis, but its answer comes after the request's bound:
    the caller gets 503, so the record, the ledger slots and the token must not stay."""
    key = tenant_key("late", rate_per_s=0.01, burst=2)
    redis_port = int(infra.redis_url.rsplit(":", 1)[1].split("/")[0])
    admit_sha = hashlib.sha1(admission.ADMIT.encode()).hexdigest().encode()
    with slow_replies(redis_port, [admit_sha], delay_s=1.5) as port:
        proxied = f"redis://127.0.0.1:{port}/{PRIVATE_DB}"
        with (
            private_gateway(redis_url=proxied, redis_timeout_s=0.5) as url,
            httpx.Client(base_url=url, headers=auth_headers(key), timeout=20) as http,
        ):
            response = http.post("/v1/jobs", json=_job(_cold(published)))
            assert response.status_code == 503, response.text
            assert response.json()["error"]["code"] == "service_unavailable"
            # The late answer arrives, the admission completes, and is withdrawn.
            deadline = time.monotonic() + 20
            while _state(private_redis, "late")["tenant_ledger"] or not private_redis.exists(
                rate_key("late")
            ):
                assert time.monotonic() < deadline, _state(private_redis, "late")
                time.sleep(0.1)
            time.sleep(2)  # past the publish that followed the late admission
    state = _state(private_redis, "late")
    assert {name: state[name] for name in ("records", "pool_ledgers", "tenant_ledger")} == {
        "records": 0,
        "pool_ledgers": 0,
        "tenant_ledger": 0,
    }
    # A message published before the withdrawal has no record: a worker drops it.
    assert state["queued"] in (0, 1)
    assert private_redis.zcard(DEADLINES) == 0
    assert float(private_redis.hget(rate_key("late"), "tokens") or 0) > 1  # type: ignore[arg-type]


def test_redis_hung_is_503_with_retry_after_within_the_bound(
    private_gateway: Callable[..., Any], published: dict[str, AdapterRecord]
) -> None:
    with (
        tcp_server(hang) as (port, _),
        private_gateway(redis_url=f"redis://127.0.0.1:{port}/0", redis_timeout_s=0.5) as url,
    ):
        # The client gives up long before a hung call would end on its own; the answer must
        # come from the gateway's own bound.
        headers = auth_headers("lf_0123456789ab_anything")
        with httpx.Client(base_url=url, headers=headers, timeout=15) as http:
            response = http.post("/v1/jobs", json=_job(_cold(published)))
    assert response.status_code == 503
    assert response.json()["error"]["code"] == "service_unavailable"
    assert response.headers["Retry-After"] == "2"


def test_oversized_body_is_413_before_it_is_read(
    private_gateway: Callable[..., Any],
    tenant_key: Callable[..., str],
    private_redis: Redis,
    published: dict[str, AdapterRecord],
) -> None:
    key = tenant_key("acme")
    big = _job(_cold(published), prompt="x" * 5000)
    with (
        private_gateway(max_body_bytes=4096) as url,
        httpx.Client(base_url=url, headers=auth_headers(key)) as http,
    ):
        declared = http.post("/v1/jobs", json=big)
        assert declared.status_code == 413
        assert declared.json()["error"]["code"] == "payload_too_large"
        assert "4096 bytes" in declared.json()["error"]["message"]

        def chunks() -> Iterator[bytes]:  # no Content-Length: counted as it arrives
            body = httpx.Request("POST", url, json=big).content
            for start in range(0, len(body), 1000):
                yield body[start : start + 1000]

        chunked = http.post(
            "/v1/jobs", content=chunks(), headers={"content-type": "application/json"}
        )
        assert chunked.status_code == 413
        assert chunked.json()["error"]["code"] == "payload_too_large"
        assert http.post("/v1/jobs", json=_job(_cold(published))).status_code == 202
    assert _state(private_redis, "acme")["records"] == 1


class _Records(logging.Handler):
    def __init__(self) -> None:
        super().__init__()
        self.records: list[logging.LogRecord] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.records.append(record)


def test_a_body_that_stops_arriving_is_408_and_its_connection_closed(
    private_gateway: Callable[..., Any],
    tenant_key: Callable[..., str],
    private_redis: Redis,
    published: dict[str, AdapterRecord],
) -> None:
    """A client that declares a body and sends part of it (a slow-loris) is answered 408
    once no piece arrived for ``LORAFLEET_BODY_TIMEOUT_S``, and its connection is closed
    instead of held; a body that arrives in slow pieces within the bound is served."""
    key = tenant_key("acme")
    body = json.dumps(_job(_cold(published))).encode()
    crashes = _Records()
    with private_gateway(body_timeout_s=1.0) as url:
        # The server's own error log (uvicorn configures its loggers as it starts).
        logging.getLogger("uvicorn.error").addHandler(crashes)
        address = httpx.URL(url)
        for route, media_type in (
            ("/v1/jobs", "application/json"),
            ("/v1/batches", "application/jsonl"),
        ):
            head = (
                f"POST {route} HTTP/1.1\r\nHost: gateway\r\nAuthorization: Bearer {key}\r\n"
                f"Content-Type: {media_type}\r\nContent-Length: {len(body)}\r\n\r\n"
            ).encode()
            with socket.create_connection((address.host, address.port), timeout=30) as held:
                held.sendall(head + body[:10])  # and nothing more
                answer = b""
                while chunk := held.recv(65536):  # until the gateway closes it
                    answer += chunk
            status, _, rest = answer.partition(b"\r\n")
            assert status == b"HTTP/1.1 408 Request Timeout", answer
            # Closed at once, not when the server's keep-alive timer (75 s in production) fires.
            assert b"connection: close" in rest.partition(b"\r\n\r\n")[0].lower(), answer
            error = json.loads(rest.partition(b"\r\n\r\n")[2])["error"]
            assert error["code"] == "body_timeout", error
            assert "1 s" in error["message"], error
    logging.getLogger("uvicorn.error").removeHandler(crashes)
    # A route that was reading the body when it was cut off does not crash on it.
    assert not [r.getMessage() for r in crashes.records if r.levelno >= logging.ERROR]
    # Per piece, not in all: 20 pieces 0.3 s apart take 6 s, past a bound of 4 s that each
    # piece is well within (a bound of 1 s failed when the machine stalled 0.7 s).
    with private_gateway(body_timeout_s=4.0) as url:
        piece = -(-len(body) // 20)

        def slowly() -> Iterator[bytes]:
            for start in range(0, len(body), piece):
                time.sleep(0.3)
                yield body[start : start + piece]

        with httpx.Client(base_url=url, headers=auth_headers(key), timeout=60) as http:
            served = http.post(
                "/v1/jobs", content=slowly(), headers={"content-type": "application/json"}
            )
            assert served.status_code == 202, served.text
    assert _state(private_redis, "acme")["records"] == 1  # the cut-off one left nothing


def test_idempotency_key_replays_the_same_job_once_even_concurrently(
    private_gateway: Callable[..., Any],
    tenant_key: Callable[..., str],
    private_redis: Redis,
    published: dict[str, AdapterRecord],
) -> None:
    key = tenant_key("acme")
    body = _job(_cold(published))
    with private_gateway() as url:
        answers = asyncio.run(
            _submit_all(url, key, [body] * 10, headers={"Idempotency-Key": "order-17"})
        )
        assert sorted(a.status_code for a in answers) == [200] * 9 + [202]
        assert len({a.json()["id"] for a in answers}) == 1
        with httpx.Client(base_url=url, headers=auth_headers(key)) as http:
            again = http.post("/v1/jobs", json=body, headers={"Idempotency-Key": "order-17"})
            assert again.status_code == 200 and again.json()["id"] == answers[0].json()["id"]
            changed = http.post(
                "/v1/jobs",
                json=_job(_cold(published), prompt="something else"),
                headers={"Idempotency-Key": "order-17"},
            )
            assert changed.status_code == 409
            assert changed.json()["error"]["code"] == "idempotency_conflict"
            assert answers[0].json()["id"] in changed.json()["error"]["message"]
    assert _state(private_redis, "acme") == {
        "records": 1,
        "pool_ledgers": 1,
        "tenant_ledger": 1,
        "queued": 1,
    }


def test_idempotency_key_of_a_refused_request_is_free_for_a_retry(
    private_gateway: Callable[..., Any],
    tenant_key: Callable[..., str],
    private_redis: Redis,
    published: dict[str, AdapterRecord],
) -> None:
    key = tenant_key("acme", max_concurrent=1)
    with private_gateway() as url, httpx.Client(base_url=url, headers=auth_headers(key)) as http:
        first = http.post("/v1/jobs", json=_job(_cold(published)))
        assert first.status_code == 202
        body = _job(_cold(published), prompt="second")
        refused = http.post("/v1/jobs", json=body, headers={"Idempotency-Key": "k2"})
        assert refused.status_code == 429
        assert http.delete(f"/v1/jobs/{first.json()['id']}").status_code == 200
        retried = http.post("/v1/jobs", json=body, headers={"Idempotency-Key": "k2"})
        assert retried.status_code == 202


def test_a_burst_wider_than_the_redis_pool_is_admitted_whole(
    private_gateway: Callable[..., Any],
    tenant_key: Callable[..., str],
    private_redis: Redis,
    published: dict[str, AdapterRecord],
) -> None:
    """120 requests at once on a gateway allowed 4 Redis connections: all wait their turn
    (redis-py's default pool would fail the excess with 503s)."""
    key = tenant_key("burst")
    # A generous bound: what is under test is the pool, not a loaded CI machine's speed.
    with private_gateway(redis_max_connections=4, redis_timeout_s=10.0) as url:
        bodies = [_job(_cold(published), f"prompt {n}") for n in range(120)]
        answers = asyncio.run(_submit_all(url, key, bodies, connections=120))
    assert [a.status_code for a in answers] == [202] * 120
    assert _state(private_redis, "burst") == {
        "records": 120,
        "pool_ledgers": 120,
        "tenant_ledger": 120,
        "queued": 120,
    }


def test_a_streamed_completion_admits_its_job_with_its_stream_open_and_a_plain_one_without(
    private_gateway: Callable[..., Any],
    tenant_key: Callable[..., str],
    private_redis: Redis,
    published: dict[str, AdapterRecord],
) -> None:
    """The route admits a streamed request's job with its stream opened (so the stream will
    hold the job's end: ``StreamHub.follow``), expiring as streams do; an unstreamed one's
    job has no stream, and names the gateway's reply channel instead (its final record is
    published there: ``JobWaiter.replies``), one the gateway listens on. (No worker runs here:
    both wait out their bound.)"""
    key = tenant_key("acme")
    body = {"model": _cold(published), "prompt": "hello", "max_tokens": 4}
    with (
        private_gateway(completion_timeout_s=0.5) as url,
        httpx.Client(base_url=url, headers=auth_headers(key), timeout=30) as http,
    ):
        with http.stream("POST", "/v1/completions", json=body | {"stream": True}) as streamed:
            assert streamed.status_code == 200
            streamed_job = streamed.headers["x-lorafleet-job-id"]
            events = "".join(streamed.iter_text())
        assert '"code":"timeout"' in events and events.endswith("data: [DONE]\n\n"), events
        plain = http.post("/v1/completions", json=body)
        assert plain.status_code == 504
        plain_job = plain.headers["x-lorafleet-job-id"]
        reply = private_redis.hget(job_key(plain_job), "reply")
        assert reply in private_redis.pubsub_channels(reply_channel("*")), reply
    assert private_redis.hget(job_key(streamed_job), "reply") is None
    assert private_redis.xrange(stream_key(streamed_job)) == [
        (STREAM_OPENED_ID, {STREAM_OPENED: "1"})
    ]
    assert 0 < int(private_redis.ttl(stream_key(streamed_job))) <= STREAM_TTL_S  # type: ignore[arg-type]
    assert not private_redis.exists(stream_key(plain_job))
