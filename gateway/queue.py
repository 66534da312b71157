"""Job messages onto their pool queues, by task name. Producer only: no worker import, and no
Celery producer either (``contracts.task_messages`` writes what ``send_task`` would).

Where the queues live in the job store's Redis (the default: one URL), the admission script
pushes the message itself, so a job is admitted and enqueued in one step. A broker on
another Redis (``LORAFLEET_BROKER_URL``) gets the messages in a second step, after the
admission; a push that fails there withdraws the admission (``gateway.submit``).
"""

from __future__ import annotations

from redis.asyncio import Redis

from contracts.jobs import JobMessage
from contracts.queues import RUN_JOB_TASK, queue_for
from contracts.redis_policy import async_client
from contracts.task_messages import task_message
from gateway.config import GatewaySettings
from gateway.routing import destination


def job_message(message: JobMessage) -> str:
    """``message`` as the Celery task message a worker consumes (``lorafleet.run_job``)."""
    summary = f"job {message.job_id} ({message.adapter}, {message.tier.value})"
    # The pool queue, also for a message pushed onto a worker's own: kombu restores an
    # unacknowledged message to the queue its envelope names, so a routed job whose worker
    # dies comes back to the shared queue of its pool, never to the dead worker's.
    queue = queue_for(message.tier, message.base_model.digest)
    return task_message(RUN_JOB_TASK, message.job_id, queue, [message.wire()], summary)


class JobQueues:
    """Publishes job messages: ``inline`` (the admission script pushes them) or onto a broker
    Redis of its own."""

    def __init__(self, settings: GatewaySettings) -> None:
        self.inline = settings.effective_broker_url == settings.redis_url
        self._broker: Redis | None = None
        if not self.inline:
            self._broker = async_client(
                settings.effective_broker_url,
                settings.redis_max_connections,
                pool_timeout_s=settings.redis_timeout_s,
                socket_timeout=settings.redis_timeout_s,
                socket_connect_timeout=settings.redis_timeout_s,
            )

    async def push(self, messages: list[JobMessage], encoded: list[str]) -> None:
        """Push ``encoded`` (the task messages of ``messages``, in order) onto the broker's
        queues in one round trip. Only for a broker of its own: inline, the admission pushed
        them. Raises the broker's error."""
        assert self._broker is not None, "inline queues are pushed by the admission script"
        async with self._broker.pipeline(transaction=False) as pipe:
            for message, body in zip(messages, encoded, strict=True):
                pipe.lpush(destination(message), body)
            await pipe.execute()

    async def close(self) -> None:
        if self._broker is not None:
            await self._broker.aclose()
