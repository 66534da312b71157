"""The gateway's task messages are what Celery's own producer writes, field for field, except
where they mean to differ (no arguments repeated in ``argsrepr``, no reply queue)."""

from __future__ import annotations

import base64
import json
import uuid
from typing import Any

from celery import Celery
from redis import Redis

from contracts.queues import RUN_JOB_TASK
from contracts.task_messages import task_message
from lorafleet.stack import LocalStack

ARGS = [{"job_id": "j1", "prompt": "a prompt \u00e9\u4e2d", "sampling": {"max_tokens": 3}}]


def _decoded(raw: str | bytes) -> tuple[dict[str, Any], Any]:
    envelope = json.loads(raw)
    return envelope, json.loads(base64.b64decode(envelope["body"]))


def test_a_direct_message_decodes_as_celery_send_task_writes_it(
    infra: LocalStack, redis: Redis
) -> None:
    queue = f"lorafleet.test-{uuid.uuid4().hex[:8]}"
    task_id = uuid.uuid4().hex
    Celery(broker=infra.redis_url).send_task(RUN_JOB_TASK, args=ARGS, queue=queue, task_id=task_id)
    try:
        celery_raw = redis.rpop(queue)
    finally:
        redis.delete(queue, f"_kombu.binding.{queue}", f"_kombu.binding_permanent.{queue}")
    celery, celery_body = _decoded(celery_raw)  # type: ignore[arg-type]
    ours, our_body = _decoded(task_message(RUN_JOB_TASK, task_id, queue, ARGS, "job j1"))

    assert our_body == celery_body  # args, kwargs, embed: what the worker runs
    assert set(ours) == set(celery)
    assert {k: v for k, v in ours.items() if k not in ("body", "headers", "properties")} == {
        k: v for k, v in celery.items() if k not in ("body", "headers", "properties")
    }
    assert set(ours["headers"]) == set(celery["headers"])
    differ = {"argsrepr", "origin", "ignore_result"}
    assert {k: v for k, v in ours["headers"].items() if k not in differ} == {
        k: v for k, v in celery["headers"].items() if k not in differ
    }
    # The prompt stays out of the header workers log and Flower shows.
    assert "a prompt" in celery["headers"]["argsrepr"]
    assert ours["headers"]["argsrepr"] == "job j1"
    assert set(ours["properties"]) == set(celery["properties"])
    differ = {"delivery_tag", "reply_to"}
    assert {k: v for k, v in ours["properties"].items() if k not in differ} == {
        k: v for k, v in celery["properties"].items() if k not in differ
    }
    assert ours["properties"]["delivery_tag"] != celery["properties"]["delivery_tag"]


def test_every_message_has_its_own_delivery_tag() -> None:
    tags = {
        json.loads(task_message(RUN_JOB_TASK, "same", "q", ARGS, "s"))["properties"]["delivery_tag"]
        for _ in range(100)
    }
    assert len(tags) == 100
