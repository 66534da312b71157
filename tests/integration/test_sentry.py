"""Sentry for real: a worker with ``SENTRY_DSN`` pointed at a recording server reports a job
that crashed on an unexpected exception, tagged with the job and its weights, without the
prompt anywhere in what was sent."""

from __future__ import annotations

import time
import uuid
from datetime import UTC, datetime
from pathlib import Path

from celery import Celery
from redis import Redis

from contracts.jobs import JobMessage, JobPublic, JobStatus, Sampling
from contracts.keys import job_key
from contracts.queues import RUN_JOB_TASK, queue_for
from contracts.registry import AdapterRecord
from contracts.routing import worker_queue
from lorafleet.stack import LocalStack
from tests.conftest import STACK_ENV
from tests.helpers import hot_alias, job_when
from tests.sentry_server import recording_sentry, sentry_events

SECRET = "SECRET-PROMPT-7f3a"


def test_an_unexpected_worker_error_reaches_sentry_tagged_and_without_the_prompt(
    stack: LocalStack, redis: Redis, published: dict[str, AdapterRecord], tmp_path: Path
) -> None:
    record = published[hot_alias(published)]
    with recording_sentry() as (dsn, received):
        worker = stack.spawn_worker(
            {
                **STACK_ENV,
                "SENTRY_DSN": dsn,
                # No tier: it takes only what is pushed onto its own queue.
                "LORAFLEET_TIERS": "",
                "LORAFLEET_WORKER_NAME": "sentry-worker@%h",
                # One worker process per disk cache directory.
                "LORAFLEET_CACHE_DIR": str(tmp_path / "cache"),
            },
            name="sentry-worker",
        )
        try:
            own_queue = worker_queue(stack.wait_worker(worker))
            now = time.time()
            job = JobPublic(
                id=uuid.uuid4().hex,
                status=JobStatus.QUEUED,
                tenant="dev",
                adapter=record.alias,
                revision=record.digest,
                tier=record.tier,
                queue=queue_for(record.tier, record.base_model.digest),
                created_at=datetime.now(tz=UTC),
            )
            redis.hset(
                job_key(job.id), mapping={"status": "queued", "record": job.model_dump_json()}
            )
            # Longer than the engine's context: only the gateway checks that, so a message
            # published around it makes the engine raise, an error no code path expects.
            message = JobMessage(
                job_id=job.id,
                tenant="dev",
                adapter=record.alias,
                revision=record.digest,
                base_model=record.base_model,
                tier=record.tier,
                prompt=SECRET + " invoice total" * 600,
                sampling=Sampling(max_tokens=4),
                accepted_at=now,
                deadline_at=now + 120,
            )
            Celery(broker=stack.redis_url).send_task(
                RUN_JOB_TASK,
                args=[message.model_dump(mode="json")],
                queue=own_queue,
                task_id=job.id,
            )
            failed = job_when(redis, job.id, lambda j: j.status.terminal, timeout_s=120)
            assert failed.error is not None and failed.error.code == "engine_error"
            deadline = time.monotonic() + 60
            while not [
                e for e in sentry_events(received) if e.get("tags", {}).get("job_id") == job.id
            ]:
                assert time.monotonic() < deadline, "no Sentry event about the job arrived"
                time.sleep(0.2)
            events = sentry_events(received)
        finally:
            worker.stop()
    expected = {
        "job_id": job.id,
        "tenant": "dev",
        "adapter": record.alias,
        "revision": record.digest,
    }
    # The task's failure (Celery integration, the worker's error log) carries the job's tags;
    # the engine's own error log, from its event-loop thread, may arrive too, untagged.
    tagged = [e for e in events if e.get("tags", {}).get("job_id") == job.id]
    assert tagged, [e.get("logger") for e in events]
    for event in tagged:
        assert {key: event["tags"].get(key) for key in expected} == expected
    assert any(event.get("exception", {}).get("values") for event in tagged)
    assert all(SECRET not in body.decode(errors="replace") for body in received)
