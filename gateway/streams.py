"""Read a streaming job's text deltas (``worker.streams``) as they arrive, once each.

A job redelivered after a crash streams again from its first token under a new execution
tag; text the caller already received is skipped, so the caller sees every character
exactly once. If the new attempt's text diverges (sampled, not greedy), the stream can't be
continued consistently and ends with ``StreamDiverged``.

The stream is the record of truth: if Redis goes away for a moment (a restart, a failover),
reading resumes from the last entry delivered, as long as the request's time lasts.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from dataclasses import dataclass
from typing import Any

from redis.asyncio import Redis
from redis.exceptions import RedisError

from contracts.jobs import JobPublic
from contracts.keys import STREAM_END, stream_key
from gateway import job_store

BLOCK_MS = 200
"""How long one read waits for a delta before the record is checked again."""

RETRY_S = (0.1, 1.0)
"""First and longest pause between reads while Redis is unreachable."""


class StreamDiverged(Exception):
    """A later attempt produced different text than what was already sent."""


@dataclass
class _Dedup:
    sent: str = ""
    attempt: str | None = None
    attempt_text: str = ""

    def fresh(self, attempt: str, text: str) -> str:
        """The part of ``text`` (the next delta of ``attempt``) not sent yet."""
        if attempt != self.attempt:
            self.attempt, self.attempt_text = attempt, ""
        before = len(self.attempt_text)
        self.attempt_text += text
        if len(self.attempt_text) <= len(self.sent):
            if not self.sent.startswith(self.attempt_text):
                raise StreamDiverged
            return ""
        if not self.attempt_text.startswith(self.sent):
            raise StreamDiverged
        new = self.attempt_text[max(before, len(self.sent)) :]
        self.sent += new
        return new


async def follow(
    redis: Redis, job_id: str, tenant: str, timeout_s: float
) -> AsyncIterator[str | JobPublic]:
    """Yield text deltas as the worker produces them, then the job once it is terminal (or
    as it is when ``timeout_s`` runs out)."""
    key = stream_key(job_id)
    last_id = "0-0"
    dedup = _Dedup()
    loop = asyncio.get_running_loop()
    deadline = loop.time() + timeout_s
    pause = RETRY_S[0]
    while True:
        try:
            # Read the record first: once it is terminal, every delta is already in the
            # stream (the worker appends them before it stores the outcome).
            job = await job_store.get_job(redis, job_id, tenant)
            done = job is None or job.status.terminal
            replies: Any = await redis.xread(
                {key: last_id}, count=256, block=None if done else BLOCK_MS
            )
        except (RedisError, OSError):
            if loop.time() + pause >= deadline:
                raise
            await asyncio.sleep(pause)
            pause = min(pause * 2, RETRY_S[1])
            continue
        pause = RETRY_S[0]
        ended = False
        for _, entries in replies or ():
            for entry_id, fields in entries:
                last_id = entry_id
                if STREAM_END in fields:  # written with the terminal record: nothing follows
                    ended = True
                    continue
                text = dedup.fresh(fields["attempt"], fields["text"])
                if text:
                    yield text
        if ended and not done:
            try:
                job = await job_store.get_job(redis, job_id, tenant)
            except (RedisError, OSError):
                continue  # read again from ``last_id``: the end marker was consumed, the
                # record's terminal status ends the loop on the next turn
            done = True
        out_of_time = loop.time() >= deadline
        if (done and (ended or not replies)) or out_of_time:
            if job is not None:
                yield job
            return
