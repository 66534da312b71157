"""Deadlines: refused above the fleet limit, enforced in the queue and during generation."""

from __future__ import annotations

import json
import time
from typing import Any

import httpx
from redis import Redis

from contracts.keys import WORKERS_INDEX, job_key, worker_key
from contracts.queues import Tier, queue_for
from contracts.registry import AdapterRecord
from lorafleet.stack import LocalStack
from tests.helpers import paused

LONG = {"max_tokens": 240, "temperature": 0.0, "ignore_eos": True}
PROMPT = "Summarise the conversation"


def _hot(published: dict[str, AdapterRecord]) -> str:
    return next(r.alias for r in published.values() if r.tier == Tier.HOT)


def _submit(gateway_url: str, adapter: str, **extra: Any) -> dict[str, Any]:
    body = {"adapter": adapter, "prompt": PROMPT, "sampling": LONG, **extra}
    response = httpx.post(f"{gateway_url}/v1/jobs", json=body)
    assert response.status_code == 202, response.text
    accepted: dict[str, Any] = response.json()
    return accepted


def _wait(gateway_url: str, job_id: str) -> dict[str, Any]:
    job: dict[str, Any] = httpx.get(
        f"{gateway_url}/v1/jobs/{job_id}", params={"wait_s": 60}, timeout=90
    ).json()
    return job


def _heartbeat(redis: Redis) -> dict[str, Any]:
    worker_id = next(iter(redis.smembers(WORKERS_INDEX)))  # type: ignore[arg-type]
    record: dict[str, Any] = json.loads(redis.get(worker_key(str(worker_id))))  # type: ignore[arg-type]
    return record


def test_deadline_above_the_fleet_limit_is_refused(
    gateway_url: str, redis: Redis, published: dict[str, AdapterRecord]
) -> None:
    before = len(list(redis.scan_iter("lorafleet:job:*")))
    response = httpx.post(
        f"{gateway_url}/v1/jobs",
        json={"adapter": _hot(published), "prompt": PROMPT, "deadline_s": 10**6},
    )
    assert response.status_code == 422
    assert response.json()["error"]["code"] == "validation_error"
    assert "deadline_s" in response.json()["error"]["message"]
    assert len(list(redis.scan_iter("lorafleet:job:*"))) == before


def test_generation_past_its_deadline_is_aborted_in_the_engine(
    stack: LocalStack, redis: Redis, published: dict[str, AdapterRecord]
) -> None:
    adapter = _hot(published)
    long_jobs = [_submit(stack.gateway_url, adapter) for _ in range(2)]
    doomed = _submit(stack.gateway_url, adapter, deadline_s=0.5)
    failed = _wait(stack.gateway_url, doomed["id"])
    assert failed["status"] == "failed"
    assert failed["error"]["code"] == "deadline_exceeded"
    assert "while generating" in failed["error"]["message"]
    assert failed["result"] is None

    # While the two long jobs still run, the engine must hold exactly those two: the doomed
    # request was aborted, not left generating to its end.
    failed_at = time.time()
    while True:
        beat = _heartbeat(redis)
        still_running = all(
            redis.hget(job_key(job["id"]), "status") == "running" for job in long_jobs
        )
        if beat["seen_at"] > failed_at:
            break
        time.sleep(0.02)
    assert still_running, "the long jobs ended before a heartbeat could be read; inconclusive"
    assert beat["engine_unfinished_requests"] == 2
    for job in long_jobs:
        assert _wait(stack.gateway_url, job["id"])["status"] == "succeeded"
    # And once they are done, the engine holds nothing.
    drained_at = time.time()
    while (beat := _heartbeat(redis))["seen_at"] <= drained_at:
        time.sleep(0.05)
    assert beat["engine_unfinished_requests"] == 0


def test_job_that_waits_in_the_queue_past_its_deadline_never_runs(
    stack: LocalStack, published: dict[str, AdapterRecord]
) -> None:
    with paused(stack, queue_for(Tier.HOT)):
        accepted = _submit(stack.gateway_url, _hot(published), deadline_s=0.5)
        time.sleep(1.0)  # let the deadline pass while the job sits in Redis
    job = _wait(stack.gateway_url, accepted["id"])
    assert job["status"] == "failed"
    assert job["error"]["code"] == "deadline_exceeded"
    assert "waited in the queue" in job["error"]["message"]
    assert job["metadata"]["load_ms"] == {"fetch": None, "verify": None, "engine_load": None}
    assert job["deadline_at"] is not None
