"""Results too large for the job store, kept in the object store instead.

The worker that ran a job writes a result whose JSON is over ``result_offload_bytes`` to S3
(``contracts.storage.result_key``: under its tenant, named by its sha256) and its record
keeps only the reference (``ResultMetadata.result_stored``); every reader reads it back and
checks its digest (the webhook worker here, the gateway in ``gateway.result_store``). If the
write fails the result stays in Redis: an outcome is never lost to the object store.
"""

from __future__ import annotations

import logging
from typing import Any

from botocore.exceptions import BotoCoreError, ClientError

from contracts.jobs import JobPublic, JobResult, ResultMetadata
from contracts.settings import ServiceSettings
from contracts.storage import decode_result, encode_result, stored_result
from worker.object_store import s3_client

log = logging.getLogger(__name__)

_MAX_BYTES_PER_CHAR = 6
"""Most bytes one character of text takes in the result's JSON (``\\u001f``)."""
_MAX_BYTES_PER_TOKEN = 11
"""Most bytes one token id takes in it (10 digits and a comma)."""
_MAX_OTHER_BYTES = 256
"""Most bytes the rest of the result takes (keys, finish reason, usage)."""


def may_exceed(result: JobResult, limit_bytes: int) -> bool:
    """Whether ``result``'s JSON may be over ``limit_bytes``, from an upper bound on its
    size: most results are far below and are never serialised to find out."""
    bound = (
        len(result.text) * _MAX_BYTES_PER_CHAR
        + len(result.token_ids) * _MAX_BYTES_PER_TOKEN
        + len(result.finish_reason or "")
        + _MAX_OTHER_BYTES
    )
    return bound > limit_bytes


def results_client(settings: ServiceSettings) -> Any:
    """The worker's S3 client for results: a finished job waits on it, so it gives up soon
    (two calls of at most 2 s to connect and 5 s to answer each)."""
    return s3_client(settings, connect_timeout_s=2.0, read_timeout_s=5.0, max_attempts=1)


WRITE_BUDGET_S = 20.0
"""A result is written to S3 only if its job has this long before the deadline sweeper
could end it; otherwise it stays in Redis, where an outcome is stored in milliseconds."""


class ResultStore:
    def __init__(self, s3: Any, bucket: str, offload_bytes: int) -> None:
        self._s3 = s3
        self._bucket = bucket
        self._offload_bytes = offload_bytes

    def place(
        self,
        tenant: str,
        result: JobResult,
        metadata: ResultMetadata,
        budget_s: float = float("inf"),
    ) -> tuple[JobResult | None, ResultMetadata]:
        """What the record keeps: ``(result, metadata)`` as given, or, for a large result
        now in the object store, ``(None, metadata naming where it is)``. ``budget_s``: how
        long the job's outcome may still take to store (see ``WRITE_BUDGET_S``)."""
        if not self._offload_bytes or not may_exceed(result, self._offload_bytes):
            return result, metadata
        if budget_s < WRITE_BUDGET_S:
            log.info("result kept in Redis: %.1f s left to store it", budget_s)
            return result, metadata
        stored, body = encode_result(tenant, result)
        if stored.size_bytes <= self._offload_bytes:
            return result, metadata
        try:
            self._s3.put_object(
                Bucket=self._bucket, Key=stored.key, Body=body, ContentType="application/json"
            )
        except (BotoCoreError, ClientError) as exc:
            log.warning(
                "result of %d bytes kept in Redis: writing %s failed (%s)",
                stored.size_bytes,
                stored.key,
                exc,
            )
            return result, metadata
        return None, metadata.model_copy(update={"result_stored": stored})

    def read(self, job: JobPublic) -> JobPublic:
        """``job`` with its result, read from the object store if it is kept there.

        Raises botocore's errors when the store is unreachable or the object is missing, and
        ``contracts.storage.StoredResultDamaged`` when its bytes are not the ones named."""
        stored = stored_result(job)
        if stored is None:
            return job
        reply = self._s3.get_object(Bucket=self._bucket, Key=stored.key)
        return job.model_copy(update={"result": decode_result(stored, reply["Body"].read())})
