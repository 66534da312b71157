"""Reading back the results a worker kept in the object store (``worker.result_store``).

The one thing the gateway does with S3, and only for results over the workers'
``result_offload_bytes``: boto3 is imported when a first such result is read, so a gateway
whose results all fit in Redis never loads it. Its calls block, so they run in a thread.
Every object is checked against the digest its record names before it is answered.
"""

from __future__ import annotations

import asyncio
import threading
from concurrent.futures import ThreadPoolExecutor
from typing import Any

from contracts.errors import ErrorCode
from contracts.jobs import JobPublic, StoredResult
from contracts.settings import ServiceSettings
from contracts.storage import (
    StoredResultDamaged,
    decode_result,
    gone_or_denied,
    stored_result,
)
from gateway.errors import RETRY_AFTER_S, ApiError


class _Missing(Exception):
    """S3 answered that the object a record names is not there (404), or that this gateway
    may not read it (403: also what a missing key is to a reader without ``s3:ListBucket``)."""


READ_THREADS = 8
"""Object-store reads one gateway process runs at once (a batch's results wait their turn)."""

MAX_WAITING = READ_THREADS * 16
"""Reads one gateway process lets wait for a thread; past it a read is refused at once (503)
rather than queued behind reads that may all be stalled on an unreachable store."""


_UNREACHABLE = "the object store holding its result is unreachable ({})"


def _unavailable(job: JobPublic, why: str) -> ApiError:
    """The retryable 503 of a succeeded job whose result cannot be read now."""
    return ApiError(
        503,
        ErrorCode.SERVICE_UNAVAILABLE,
        f"Job {job.id} succeeded, but {why}; retry.",
        headers={"Retry-After": str(RETRY_AFTER_S)},
    )


class ResultReader:
    def __init__(
        self,
        settings: ServiceSettings,
        budget_s: float = 10.0,
        max_waiting: int = MAX_WAITING,
    ) -> None:
        """``budget_s``: how long one read may take in all, its wait for a thread included
        (the gateway's ``request_timeout_s``); past it the caller gets a 503."""
        self._settings = settings
        self._budget_s = budget_s
        self._max_waiting = max_waiting
        self._waiting = 0  # reads submitted and not yet ended (the loop's thread only)
        self._client: Any = None
        self._closed = False
        self._client_lock = threading.Lock()
        # Its own threads: reads that hang in an outage must not hold the loop's default
        # executor (DNS lookups for new Redis connections use it).
        self._pool = ThreadPoolExecutor(READ_THREADS, thread_name_prefix="result-reads")

    def close(self) -> None:
        self._pool.shutdown(wait=False, cancel_futures=True)
        with self._client_lock:
            self._closed = True  # a read already in a thread makes no client after this
            if self._client is not None:
                self._client.close()
                self._client = None

    async def read(self, job: JobPublic) -> JobPublic:
        """``job`` with its result, read from the object store if its record keeps only a
        reference; an ``ApiError`` if it cannot be read (the job itself is unchanged)."""
        stored = stored_result(job)
        if stored is None:
            return job
        if self._waiting >= self._max_waiting:
            raise _unavailable(
                job,
                "its result is kept in the object store and this gateway has "
                f"{self._waiting} reads of it waiting already",
            )
        self._waiting += 1
        try:
            async with asyncio.timeout(self._budget_s):
                body = await asyncio.get_running_loop().run_in_executor(
                    self._pool, self._get, stored
                )
        except _Missing as exc:
            raise ApiError(
                500,
                ErrorCode.INTERNAL_ERROR,
                f"Job {job.id} succeeded, but its result, kept in the object store as "
                f"{stored.key}, could not be read ({exc}): it is gone (the bucket must keep "
                "results as long as job records, LORAFLEET_JOB_TTL_S; see the lifecycle rule "
                "in the README) or the gateway may not read it (s3:GetObject).",
            ) from None
        except TimeoutError:
            why = _UNREACHABLE.format(f"no answer within {self._budget_s:g} s")
            raise _unavailable(job, why) from None
        except Exception as exc:  # botocore's errors, which this module does not import
            raise _unavailable(job, _UNREACHABLE.format(type(exc).__name__)) from exc
        finally:
            self._waiting -= 1
        try:
            result = decode_result(stored, body)
        except StoredResultDamaged as exc:
            raise ApiError(
                500,
                ErrorCode.INTERNAL_ERROR,
                f"Job {job.id} succeeded, but its result in the object store is damaged: {exc}.",
            ) from exc
        return job.model_copy(update={"result": result})

    def _get(self, stored: StoredResult) -> bytes:
        client = self._s3()
        from botocore.exceptions import ClientError

        try:
            reply = client.get_object(Bucket=self._settings.s3_bucket, Key=stored.key)
        except ClientError as exc:
            if gone_or_denied(exc.response):
                status = exc.response["ResponseMetadata"]["HTTPStatusCode"]
                code = exc.response.get("Error", {}).get("Code", "")
                raise _Missing(f"S3 answered {status} {code}".strip()) from None
            raise
        body: bytes = reply["Body"].read()
        return body

    def _s3(self) -> Any:
        with self._client_lock:
            if self._closed:
                raise RuntimeError("the gateway is stopping")
            if self._client is None:
                import boto3
                from botocore.config import Config

                settings = self._settings
                self._client = boto3.client(
                    "s3",
                    endpoint_url=settings.s3_endpoint_url,
                    region_name=settings.s3_region,
                    # A caller waits on these: one retry, each try answered within seconds
                    # (``read`` gives up sooner still, at its budget; the thread's calls end
                    # within ``contracts.storage.longest_call_s``).
                    config=Config(
                        retries={"max_attempts": 1, "mode": "standard"},
                        connect_timeout=2,
                        read_timeout=5,
                    ),
                )
            return self._client
