"""Deadlines: refused above the fleet limit, enforced in the queue and during generation."""

from __future__ import annotations

import time

import httpx
import pytest
from redis import Redis

from contracts.queues import Tier, queue_for
from contracts.registry import AdapterRecord
from lorafleet.stack import LocalStack
from tests.helpers import (
    assert_engine_drains,
    fresh_heartbeat,
    hot_alias,
    job_records,
    paused,
    submit_job,
    wait_job,
    worker_heartbeat,
)


def test_deadline_above_the_fleet_limit_is_refused(
    api: httpx.Client, redis: Redis, published: dict[str, AdapterRecord]
) -> None:
    before = job_records(redis)
    response = api.post(
        "/v1/jobs",
        json={
            "adapter": hot_alias(published),
            "prompt": "Summarise the conversation",
            "deadline_s": 10**6,
        },
    )
    assert response.status_code == 422
    assert response.json()["error"]["code"] == "validation_error"
    assert "deadline_s" in response.json()["error"]["message"]
    assert job_records(redis) == before


def test_generation_past_its_deadline_is_aborted_in_the_engine(
    api: httpx.Client, redis: Redis, published: dict[str, AdapterRecord]
) -> None:
    for _ in range(5):
        aborted_before = fresh_heartbeat(redis)["engine_aborted_requests"]
        doomed = submit_job(api, hot_alias(published), deadline_s=0.5)
        failed = wait_job(api, doomed["id"])
        assert failed["status"] == "failed"
        assert failed["error"]["code"] == "deadline_exceeded"
        # Raised by the timeout around the engine call: the generation coroutine was
        # cancelled, which makes vLLM abort the request.
        if "while generating" in failed["error"]["message"]:
            break
        # A stalled machine spent the half second before the engine: that is not this test.
    else:
        pytest.fail(f"no job reached the engine within its deadline: {failed['error']}")
    assert failed["result"] is None
    assert_engine_drains(redis)
    assert worker_heartbeat(redis)["engine_aborted_requests"] == aborted_before + 1


@pytest.mark.pauses_consumer
def test_job_that_waits_in_the_queue_past_its_deadline_never_runs(
    stack: LocalStack, api: httpx.Client, published: dict[str, AdapterRecord]
) -> None:
    record = published[hot_alias(published)]
    with paused(stack, queue_for(Tier.HOT, record.base_model.digest)):
        accepted = submit_job(api, record.alias, deadline_s=0.5)
        time.sleep(1.0)  # let the deadline pass while the job sits in Redis
    job = wait_job(api, accepted["id"])
    assert job["status"] == "failed"
    assert job["error"]["code"] == "deadline_exceeded"
    assert "waited in the queue" in job["error"]["message"]
    # Whoever meets it first ends it, both without running it: the worker (its metadata says
    # nothing was loaded) or, on a slow machine, the deadline sweeper (no worker saw it).
    if job["metadata"] is not None:
        assert job["metadata"]["load_ms"] == {"fetch": None, "verify": None, "engine_load": None}
    else:
        assert "the deadline sweeper ended it" in job["error"]["message"]
        assert job["attempts"] == 0
    assert job["deadline_at"] is not None
