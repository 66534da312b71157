"""Sentry for real: a worker with ``SENTRY_DSN`` pointed at a recording server reports a job
that crashed on an unexpected exception, tagged with the job and its weights, without the
prompt anywhere in what was sent."""

from __future__ import annotations

import gzip
import json
import threading
import time
import uuid
from collections.abc import Iterator
from contextlib import contextmanager
from datetime import UTC, datetime
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any

from celery import Celery
from redis import Redis

from contracts.jobs import JobMessage, JobPublic, JobStatus, Sampling
from contracts.keys import job_key
from contracts.queues import RUN_JOB_TASK
from contracts.registry import AdapterRecord
from lorafleet.processes import free_port, stop_group
from lorafleet.stack import LocalStack
from tests.conftest import STACK_ENV
from tests.helpers import hot_alias, job_when

SECRET = "SECRET-PROMPT-7f3a"
QUEUE = "lorafleet.sentry-test"


@contextmanager
def _sentry() -> Iterator[tuple[str, list[bytes]]]:
    """A server that accepts Sentry envelopes; yields its DSN and the (decoded) bodies."""
    received: list[bytes] = []

    class Handler(BaseHTTPRequestHandler):
        def do_POST(self) -> None:
            body = self.rfile.read(int(self.headers.get("content-length") or 0))
            if self.headers.get("content-encoding") == "gzip":
                body = gzip.decompress(body)
            received.append(body)
            self.send_response(200)
            self.send_header("content-length", "2")
            self.end_headers()
            self.wfile.write(b"{}")

        def log_message(self, *_: Any) -> None:
            pass

    port = free_port()
    server = ThreadingHTTPServer(("127.0.0.1", port), Handler)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    try:
        yield f"http://public@127.0.0.1:{port}/1", received
    finally:
        server.shutdown()
        server.server_close()


def _events(bodies: list[bytes]) -> list[dict[str, Any]]:
    """The ``event`` items of Sentry envelopes (header line, then item header + payload)."""
    events = []
    for body in bodies:
        lines = body.split(b"\n")
        for header, payload in zip(lines[1::2], lines[2::2], strict=False):
            if json.loads(header).get("type") == "event":
                events.append(json.loads(payload))
    return events


def test_an_unexpected_worker_error_reaches_sentry_tagged_and_without_the_prompt(
    stack: LocalStack, redis: Redis, published: dict[str, AdapterRecord], tmp_path: Path
) -> None:
    record = published[hot_alias(published)]
    with _sentry() as (dsn, received):
        worker = stack.spawn_worker(
            {
                **STACK_ENV,
                "SENTRY_DSN": dsn,
                "LORAFLEET_QUEUES": QUEUE,
                "LORAFLEET_WORKER_NAME": "sentry-worker@%h",
                # One worker process per disk cache directory.
                "LORAFLEET_CACHE_DIR": str(tmp_path / "cache"),
            },
            name="sentry-worker",
        )
        try:
            stack.wait_worker(worker)
            now = time.time()
            job = JobPublic(
                id=uuid.uuid4().hex,
                status=JobStatus.QUEUED,
                tenant="dev",
                adapter=record.alias,
                revision=record.digest,
                tier=record.tier,
                queue=QUEUE,
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
                RUN_JOB_TASK, args=[message.model_dump(mode="json")], queue=QUEUE, task_id=job.id
            )
            failed = job_when(redis, job.id, lambda j: j.status.terminal, timeout_s=120)
            assert failed.error is not None and failed.error.code == "engine_error"
            deadline = time.monotonic() + 60
            while not [e for e in _events(received) if e.get("tags", {}).get("job_id") == job.id]:
                assert time.monotonic() < deadline, "no Sentry event about the job arrived"
                time.sleep(0.2)
            events = _events(received)
        finally:
            stop_group(worker.pid, process=worker.process)
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
