"""``DELETE /v1/jobs/{id}``: a queued job never runs, a running one is aborted in the engine."""

from __future__ import annotations

import time

import httpx
import pytest
from redis import Redis

from contracts.keys import job_key
from contracts.queues import Tier, queue_for
from contracts.registry import AdapterRecord
from lorafleet.stack import LocalStack
from tests.helpers import (
    assert_engine_drains,
    hot_alias,
    paused,
    submit_job,
    wait_job,
    worker_heartbeat,
)


def _wait_running(gateway_url: str, job_id: str, timeout_s: float = 60) -> None:
    deadline = time.monotonic() + timeout_s
    while httpx.get(f"{gateway_url}/v1/jobs/{job_id}").json()["status"] != "running":
        assert time.monotonic() < deadline, "the job never started"
        time.sleep(0.05)


def test_running_job_is_cancelled_and_aborted_in_the_engine(
    stack: LocalStack, redis: Redis, published: dict[str, AdapterRecord]
) -> None:
    accepted = submit_job(stack.gateway_url, hot_alias(published))
    _wait_running(stack.gateway_url, accepted["id"])
    response = httpx.delete(f"{stack.gateway_url}/v1/jobs/{accepted['id']}")
    assert response.status_code == 200, response.text
    cancelled = response.json()
    assert cancelled["status"] == "cancelled"
    assert cancelled["error"]["code"] == "cancelled"
    assert "while running" in cancelled["error"]["message"]
    # The engine request is gone (a 240-token generation would still hold it otherwise)
    # and the worker wrote nothing over the cancellation.
    assert_engine_drains(redis)
    assert worker_heartbeat(redis)["jobs_running"] == 0
    job = wait_job(stack.gateway_url, accepted["id"])
    assert job["status"] == "cancelled"
    assert job["result"] is None
    assert job["attempts"] == 1

    # Cancelling again is answered the same; a finished job can't be cancelled.
    again = httpx.delete(f"{stack.gateway_url}/v1/jobs/{accepted['id']}")
    assert again.status_code == 200
    assert again.json()["status"] == "cancelled"


def test_finished_job_is_not_cancelled(
    stack: LocalStack, published: dict[str, AdapterRecord]
) -> None:
    accepted = submit_job(stack.gateway_url, hot_alias(published), sampling={"max_tokens": 2})
    assert wait_job(stack.gateway_url, accepted["id"])["status"] == "succeeded"
    response = httpx.delete(f"{stack.gateway_url}/v1/jobs/{accepted['id']}")
    assert response.status_code == 409
    assert response.json()["error"]["code"] == "job_finished"
    assert "succeeded" in response.json()["error"]["message"]
    assert wait_job(stack.gateway_url, accepted["id"])["status"] == "succeeded"


def test_unknown_job_cannot_be_cancelled(stack: LocalStack, redis: Redis) -> None:
    response = httpx.delete(f"{stack.gateway_url}/v1/jobs/{'0' * 32}")
    assert response.status_code == 404
    assert response.json()["error"]["code"] == "job_not_found"
    assert not redis.exists(job_key("0" * 32))


@pytest.mark.pauses_consumer
def test_queued_job_that_was_cancelled_never_runs(
    stack: LocalStack, redis: Redis, published: dict[str, AdapterRecord]
) -> None:
    queue = queue_for(Tier.HOT)
    with paused(stack, queue):
        doomed = submit_job(stack.gateway_url, hot_alias(published))
        response = httpx.delete(f"{stack.gateway_url}/v1/jobs/{doomed['id']}")
        assert response.status_code == 200, response.text
        assert response.json()["status"] == "cancelled"
        assert "while queued" in response.json()["error"]["message"]
        assert redis.llen(queue) == 1  # still in Redis: the worker must skip it
        follower = submit_job(stack.gateway_url, hot_alias(published), sampling={"max_tokens": 2})
    # Both messages are consumed once the queue resumes; the cancelled one is never started.
    assert wait_job(stack.gateway_url, follower["id"])["status"] == "succeeded"
    deadline = time.monotonic() + 30
    while redis.llen(queue):
        assert time.monotonic() < deadline, "the cancelled job's message was never consumed"
        time.sleep(0.1)
    job = wait_job(stack.gateway_url, doomed["id"])
    assert job["status"] == "cancelled"
    assert job["attempts"] == 0
    assert job["started_at"] is None
    assert job["result"] is None
