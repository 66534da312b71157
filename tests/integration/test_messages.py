"""A queue message the worker cannot read fails its job visibly instead of losing it."""

from __future__ import annotations

import uuid
from datetime import UTC, datetime

import httpx
from celery import Celery
from redis import Redis

from contracts.jobs import JobPublic, JobStatus
from contracts.keys import job_key
from contracts.queues import RUN_JOB_TASK, Tier, queue_for
from contracts.registry import BaseModelRef
from lorafleet.stack import LocalStack


def test_malformed_message_fails_its_job_with_internal_error(
    stack: LocalStack, api: httpx.Client, redis: Redis, base_model: BaseModelRef
) -> None:
    cold = queue_for(Tier.COLD, base_model.digest)
    job = JobPublic(
        id=uuid.uuid4().hex,
        status=JobStatus.QUEUED,
        adapter="lora-00-r8-qv",
        revision="sha256:" + "a" * 64,
        tenant="dev",
        tier=Tier.COLD,
        queue=cold,
        created_at=datetime.now(tz=UTC),
    )
    redis.hset(job_key(job.id), mapping={"status": "queued", "record": job.model_dump_json()})
    producer = Celery(broker=stack.redis_url)
    producer.send_task(
        RUN_JOB_TASK,
        args=[{"job_id": job.id, "prompt": "no adapter, no revision"}],
        queue=cold,
    )
    answer = api.get(f"/v1/jobs/{job.id}", params={"wait_s": 60}, timeout=90).json()
    assert answer["status"] == "failed"
    assert answer["error"]["code"] == "internal_error"
    assert answer["result"] is None
