"""Enqueue jobs by task name on their tier's queue. Producer only: no worker import."""

from __future__ import annotations

from celery import Celery

from contracts.jobs import JobMessage
from contracts.queues import RUN_JOB_TASK, queue_for


def make_producer(broker_url: str, timeout_s: float) -> Celery:
    """A Celery app used only to publish; every publish fails within ``timeout_s``-ish bounds."""
    producer = Celery("lorafleet-gateway", broker=broker_url)
    producer.conf.update(
        broker_connection_timeout=timeout_s,
        broker_transport_options={"socket_timeout": timeout_s, "socket_connect_timeout": timeout_s},
        # One quick retry on a dropped connection; a longer loop would hold the HTTP request
        # past the point where answering 503 is the honest outcome.
        task_publish_retry_policy={"max_retries": 1, "interval_start": 0, "interval_step": 0.2},
    )
    return producer


def enqueue_many(producer: Celery, messages: list[JobMessage]) -> None:
    """Publish ``messages`` in order over one broker connection. Raises on the first failure."""
    with producer.connection_for_write() as connection, producer.producer_or_acquire() as pub:
        for message in messages:
            producer.send_task(
                RUN_JOB_TASK,
                args=[message.wire()],
                queue=queue_for(message.tier),
                task_id=message.job_id,
                connection=connection,
                producer=pub,
            )


def enqueue(producer: Celery, message: JobMessage) -> str:
    """Publish ``message`` on its tier queue; returns the queue name. Raises on failure."""
    queue = queue_for(message.tier)
    producer.send_task(
        RUN_JOB_TASK,
        args=[message.wire()],
        queue=queue,
        task_id=message.job_id,
    )
    return queue
