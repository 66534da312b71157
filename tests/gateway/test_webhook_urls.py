"""Callback URLs that could reach inside the network are refused at submission, and again
at connect time against the address actually connected to (DNS rebinding)."""

from __future__ import annotations

import ipaddress
import socket
import threading
import time
from collections.abc import Callable
from datetime import UTC, datetime
from typing import Any

import httpx
import pytest
from redis import Redis

from contracts.queues import Tier, queue_for
from contracts.registry import AdapterRecord
from contracts.webhooks import DeliveryState, IPAddress, job_event_id
from gateway import webhooks as gateway_webhooks
from lorafleet.client import auth_headers
from tests.helpers import job_records
from tests.sockets import tcp_server
from worker.webhooks.config import WebhookSettings
from worker.webhooks.deliver import Deliverer
from worker.webhooks.schedule import Schedule

FORBIDDEN = [
    "https://127.0.0.1/hook",
    "https://localhost/hook",
    "https://2130706433/hook",  # 127.0.0.1 as one decimal number
    "https://10.1.2.3/hook",
    "https://172.16.0.1/hook",
    "https://192.168.1.1/hook",
    "https://169.254.169.254/latest/meta-data",
    "https://100.64.0.1/hook",
    "https://224.0.0.1/hook",
    "https://0.0.0.0/hook",
    "https://[::1]/hook",
    "https://[::]/hook",
    "https://[fe80::1]/hook",
    "https://[fd00::1]/hook",
    "https://[ff02::1]/hook",
    "https://[::ffff:127.0.0.1]/hook",
    "https://[::ffff:10.0.0.1]/hook",
    "https://[64:ff9b::7f00:1]/hook",
    "https://[64:ff9b::a9fe:a9fe]/hook",
    "https://[2002:7f00:1::1]/hook",
    "http://93.184.216.34/hook",  # public, but not https
    "https://user:pass@93.184.216.34/hook",
    "ftp://93.184.216.34/hook",
]


def _cold(published: dict[str, AdapterRecord]) -> str:
    return next(r.alias for r in published.values() if r.tier == Tier.COLD)


@pytest.fixture
def public_dns(monkeypatch: pytest.MonkeyPatch) -> None:
    """The gateway resolves ``*.test`` names to a public address (no DNS needed)."""
    real = gateway_webhooks.resolve

    async def resolve(host: str, port: int) -> list[IPAddress]:
        if host.endswith(".test"):
            return [ipaddress.ip_address("93.184.216.34")]
        return await real(host, port)

    monkeypatch.setattr(gateway_webhooks, "resolve", resolve)


def test_each_forbidden_callback_is_refused_at_submission_and_enqueues_nothing(
    private_gateway: Callable[..., Any],
    tenant_key: Callable[..., str],
    private_redis: Redis,
    published: dict[str, AdapterRecord],
    public_dns: None,
) -> None:
    key = tenant_key("acme")
    with private_gateway() as url, httpx.Client(base_url=url, headers=auth_headers(key)) as http:
        for target in FORBIDDEN:
            body = {"adapter": _cold(published), "prompt": "hi", "webhook": {"url": target}}
            response = http.post("/v1/jobs", json=body)
            assert response.status_code == 422, (target, response.text)
            error = response.json()["error"]
            assert error["code"] == "webhook_url_forbidden", target
            assert "Nothing was enqueued" in error["message"]
        allowed = {"adapter": _cold(published), "prompt": "hi"}
        allowed["webhook"] = {"url": "https://hooks.example.test/x"}  # type: ignore[assignment]
        assert http.post("/v1/jobs", json=allowed).status_code == 202
    assert job_records(private_redis) == 1


def test_a_host_rebound_to_loopback_after_submission_is_never_connected_to(
    private_gateway: Callable[..., Any],
    tenant_key: Callable[..., str],
    private_redis: Redis,
    published: dict[str, AdapterRecord],
    public_dns: None,
) -> None:
    key = tenant_key("acme")
    with tcp_server(lambda conn: conn.close()) as (port, accepted):
        url = f"https://rebind.test:{port}/hook"
        with (
            private_gateway() as gateway,
            httpx.Client(base_url=gateway, headers=auth_headers(key)) as http,
        ):
            body = {"adapter": _cold(published), "prompt": "hi", "webhook": {"url": url}}
            accepted_job = http.post("/v1/jobs", json=body)
            assert accepted_job.status_code == 202  # resolved to a public address just now
            job_id = accepted_job.json()["id"]
            # Ending the job (here: cancelling it) creates its webhook event.
            assert http.delete(f"/v1/jobs/{job_id}").status_code == 200

        schedule = Schedule(private_redis)
        event = schedule.event(job_event_id(job_id))
        assert event is not None and event.url == url

        def rebound(host: str, port: int) -> list[IPAddress]:
            return [ipaddress.ip_address("127.0.0.1")]  # the name now points at loopback

        deliverer = Deliverer(private_redis, WebhookSettings(), resolver=rebound)
        conclusion = deliverer.attempt(event)
        assert conclusion.state == DeliveryState.DEAD
        assert conclusion.error is not None and "loopback" in conclusion.error
        assert accepted == []

        # The same attempt where loopback is allowed does reach the listener: the check
        # above would have seen a connection.
        permissive = WebhookSettings(webhook_allow_loopback=True, webhook_timeout_s=1)
        Deliverer(private_redis, permissive, resolver=rebound).attempt(event)
        assert len(accepted) == 1


def _event_for(private_redis: Redis, url: str) -> Any:
    """A pending webhook event for ``url``, as a finished job would create it."""
    from contracts.job_records import ADVANCE, advance_call
    from contracts.jobs import JobPublic, JobStatus
    from contracts.keys import job_key
    from contracts.webhooks import WebhookTarget

    job = JobPublic(
        id=f"{time.monotonic_ns()}",
        status=JobStatus.QUEUED,
        tenant="acme",
        adapter="a",
        revision="sha256:" + "0" * 64,
        tier=Tier.HOT,
        queue=queue_for(Tier.HOT, "sha256:" + "b" * 64),
        created_at=datetime.now(tz=UTC),
        webhook=WebhookTarget(url=url),
    )
    private_redis.hset(job_key(job.id), mapping={"status": "queued", "record": "{}"})
    done = job.model_copy(update={"status": JobStatus.SUCCEEDED})
    keys, args = advance_call(done, 600)
    private_redis.register_script(ADVANCE)(keys=keys, args=args)
    event = Schedule(private_redis).event(job_event_id(job.id))
    assert event is not None
    return event


LOCAL = WebhookSettings(webhook_allow_http=True, webhook_allow_loopback=True, webhook_timeout_s=0.5)


def test_a_slow_receiver_times_out_and_is_retried(private_redis: Redis) -> None:
    release, closed = threading.Event(), threading.Event()

    def slow(conn: socket.socket) -> None:
        conn.recv(65536)
        release.wait(60)  # answers nothing until the attempt has given up
        conn.close()
        closed.set()

    with tcp_server(slow) as (port, _):
        event = _event_for(private_redis, f"http://127.0.0.1:{port}/hook")
        conclusion = Deliverer(private_redis, LOCAL).attempt(event)
        # The attempt gave up on its own: the receiver had neither answered nor hung up.
        assert not closed.is_set()
        release.set()
    assert conclusion.state == DeliveryState.PENDING
    assert conclusion.error is not None and "Timeout" in conclusion.error


def test_a_huge_response_is_read_only_up_to_the_cap(private_redis: Redis) -> None:
    sent: list[int] = []

    def huge(conn: socket.socket) -> None:
        conn.recv(65536)
        conn.sendall(b"HTTP/1.1 200 OK\r\ncontent-length: 104857600\r\n\r\n")
        chunk = b"x" * 65536
        try:
            for _ in range(1600):  # 100 MiB, unless the client stops reading
                conn.sendall(chunk)
                sent.append(len(chunk))
        except OSError:
            pass
        conn.close()

    with tcp_server(huge) as (port, _):
        event = _event_for(private_redis, f"http://127.0.0.1:{port}/hook")
        conclusion = Deliverer(private_redis, LOCAL).attempt(event)
        time.sleep(0.5)
    assert conclusion.state == DeliveryState.DELIVERED
    assert sum(sent) < 50 * 1024 * 1024  # the deliverer hung up long before the end


def test_the_event_of_a_withdrawn_batch_is_dead_not_an_error(private_redis: Redis) -> None:
    """A batch whose jobs all finished before its admission was withdrawn (its reply lost)
    leaves a ``batch.completed`` event behind a tombstone with no record: the attempt ends
    the event (dead, nothing sent), instead of failing on the missing record every time."""
    from contracts.job_records import WITHDRAWN
    from contracts.keys import batch_key
    from worker.webhooks.schedule import Event

    batch_id = f"b{time.monotonic_ns()}"
    private_redis.hset(batch_key(batch_id), WITHDRAWN, 1)
    event = Event(
        event_id=f"evt_batch_{batch_id}",
        url="https://example.test/hook",
        tenant="acme",
        kind="batch",
        subject=batch_id,
        state=DeliveryState.PENDING,
        attempts=0,
        created_at=time.time(),
    )
    conclusion = Deliverer(private_redis, LOCAL).attempt(event)
    assert conclusion.state == DeliveryState.DEAD
    assert conclusion.error is not None and "expired" in conclusion.error
