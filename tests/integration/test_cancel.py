"""``DELETE /v1/jobs/{id}``: a queued job never runs, a running one is aborted in the engine."""

from __future__ import annotations

import json
import socket
import time

import httpx
import pytest
from redis import Redis

from contracts.keys import idempotency_key, job_key
from contracts.queues import Tier, queue_for
from contracts.registry import AdapterRecord
from lorafleet.stack import DEV_TENANT, LocalStack
from tests.helpers import (
    LONG_SAMPLING,
    assert_engine_drains,
    fresh_heartbeat,
    hot_alias,
    job_when,
    paused,
    submit_job,
    wait_job,
    worker_heartbeat,
)


def test_running_job_is_cancelled_and_aborted_in_the_engine(
    api: httpx.Client, redis: Redis, published: dict[str, AdapterRecord]
) -> None:
    aborted_before = fresh_heartbeat(redis)["engine_aborted_requests"]
    # A batch, so each long job takes seconds: the cancellation lands mid-generation.
    batch = [submit_job(api, hot_alias(published))["id"] for _ in range(11)]
    # The target streams its text, so the test knows it is generating (not merely claimed)
    # when it cancels; its stream then ends with the cancellation.
    body = {"model": hot_alias(published), "prompt": "Summarise", "stream": True, **LONG_SAMPLING}
    with api.stream("POST", "/v1/completions", json=body) as stream:
        assert stream.status_code == 200
        target = stream.headers["x-lorafleet-job-id"]
        events = (line.removeprefix("data: ") for line in stream.iter_lines() if line)
        assert json.loads(next(events))["choices"][0]["text"]
        response = api.delete(f"/v1/jobs/{target}")
        assert response.status_code == 200, response.text
        *_, error, done = events
    assert json.loads(error)["error"]["code"] == "cancelled"
    assert done == "[DONE]"
    cancelled = response.json()
    assert cancelled["status"] == "cancelled"
    assert cancelled["error"]["code"] == "cancelled"
    assert "while running" in cancelled["error"]["message"]

    for job_id in batch:
        assert wait_job(api, job_id)["status"] == "succeeded"
    # The worker aborted the engine request (its generate call was cancelled), the engine
    # holds nothing, and the worker wrote nothing over the cancellation.
    assert_engine_drains(redis)
    beat = worker_heartbeat(redis)
    assert beat["engine_aborted_requests"] == aborted_before + 1
    assert beat["jobs_running"] == 0
    job = wait_job(api, target)
    assert job["status"] == "cancelled"
    assert job["result"] is None
    assert job["attempts"] == 1

    # Cancelling again is answered the same.
    again = api.delete(f"/v1/jobs/{target}")
    assert again.status_code == 200
    assert again.json()["status"] == "cancelled"


def test_finished_job_is_not_cancelled(
    api: httpx.Client, published: dict[str, AdapterRecord]
) -> None:
    accepted = submit_job(api, hot_alias(published), sampling={"max_tokens": 2})
    assert wait_job(api, accepted["id"])["status"] == "succeeded"
    response = api.delete(f"/v1/jobs/{accepted['id']}")
    assert response.status_code == 409
    assert response.json()["error"]["code"] == "job_finished"
    assert "succeeded" in response.json()["error"]["message"]
    assert wait_job(api, accepted["id"])["status"] == "succeeded"


def test_unknown_job_cannot_be_cancelled(api: httpx.Client, redis: Redis) -> None:
    response = api.delete(f"/v1/jobs/{'0' * 32}")
    assert response.status_code == 404
    assert response.json()["error"]["code"] == "job_not_found"
    assert not redis.exists(job_key("0" * 32))


@pytest.mark.pauses_consumer
def test_queued_job_that_was_cancelled_never_runs(
    stack: LocalStack, api: httpx.Client, redis: Redis, published: dict[str, AdapterRecord]
) -> None:
    record = published[hot_alias(published)]
    queue = queue_for(Tier.HOT, record.base_model.digest)
    with paused(stack, queue):
        # An earlier test's message may still wait here (a job the deadline sweeper ended
        # while the queue was paused is consumed only after it resumes).
        before = redis.llen(queue)
        doomed = submit_job(api, hot_alias(published))
        response = api.delete(f"/v1/jobs/{doomed['id']}")
        assert response.status_code == 200, response.text
        assert response.json()["status"] == "cancelled"
        assert "while queued" in response.json()["error"]["message"]
        assert redis.llen(queue) == before + 1  # still in Redis: the worker must skip it
        follower = submit_job(api, hot_alias(published), sampling={"max_tokens": 2})
    # Both messages are consumed once the queue resumes; the cancelled one is never started.
    assert wait_job(api, follower["id"])["status"] == "succeeded"
    deadline = time.monotonic() + 30
    while redis.llen(queue):
        assert time.monotonic() < deadline, "the cancelled job's message was never consumed"
        time.sleep(0.1)
    job = wait_job(api, doomed["id"])
    assert job["status"] == "cancelled"
    assert job["attempts"] == 0
    assert job["started_at"] is None
    assert job["result"] is None


def test_completions_whose_client_disconnects_are_cancelled_and_aborted(
    api: httpx.Client, redis: Redis, published: dict[str, AdapterRecord]
) -> None:
    """As vLLM's own server does: a client that goes away stops its generation (streaming or
    not); the engine holds nothing for nobody."""
    aborted_before = fresh_heartbeat(redis)["engine_aborted_requests"]
    body = {"model": hot_alias(published), "prompt": "Summarise", **LONG_SAMPLING}
    with api.stream("POST", "/v1/completions", json={**body, "stream": True}) as stream:
        assert stream.status_code == 200
        streamed = stream.headers["x-lorafleet-job-id"]
        lines = (line for line in stream.iter_lines() if line)
        assert json.loads(next(lines).removeprefix("data: "))["choices"][0]["text"]
    # The stream is closed after its first token: the connection is gone.
    job = job_when(redis, streamed, lambda j: j.status.terminal)
    assert job.status == "cancelled", job.model_dump_json()

    # Not streamed: the client sends its request, and hangs up once the job generates.
    key = f"gives-up-{time.monotonic_ns()}"
    payload = json.dumps(body).encode()
    url = httpx.URL(str(api.base_url))
    head = (
        "POST /v1/completions HTTP/1.1\r\n"
        f"Host: {url.host}\r\nAuthorization: {api.headers['Authorization']}\r\n"
        f"Idempotency-Key: {key}\r\nContent-Type: application/json\r\n"
        f"Content-Length: {len(payload)}\r\n\r\n"
    )
    with socket.create_connection((url.host, url.port)) as client:
        client.sendall(head.encode() + payload)
        deadline = time.monotonic() + 60
        # Its idempotency key is reserved (naming the job) just before the job is admitted:
        # admitted once the job's record exists too.
        while (raw := redis.get(idempotency_key(DEV_TENANT, key))) is None or not redis.hexists(
            job_key(json.loads(str(raw))["job_id"]), "record"
        ):
            assert time.monotonic() < deadline, "the request was never admitted"
            time.sleep(0.02)
        job_id = json.loads(str(raw))["job_id"]
        # Woken by its record's changes: a poll could miss a run of about a second.
        started = job_when(redis, job_id, lambda j: j.status != "queued")
        assert started.status == "running", started.model_dump_json()
    waited = job_when(redis, job_id, lambda j: j.status.terminal, timeout_s=60)
    assert waited.status == "cancelled", waited.model_dump_json()
    assert waited.error is not None and "cancelled by the caller" in waited.error.message

    assert_engine_drains(redis)
    assert worker_heartbeat(redis)["engine_aborted_requests"] >= aborted_before + 1
