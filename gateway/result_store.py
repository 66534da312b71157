"""Reading back the results a worker kept in the object store (``worker.result_store``).

The one thing the gateway does with S3, and only for results over the workers'
``result_offload_bytes``: boto3 is imported when a first such result is read, so a gateway
whose results all fit in Redis never loads it. Its calls block, so they run in a thread.
Every object is checked against the digest its record names before it is answered.
"""

from __future__ import annotations

import asyncio
import threading
from typing import Any

from contracts.errors import ErrorCode
from contracts.jobs import JobPublic, StoredResult
from contracts.settings import ServiceSettings
from contracts.storage import StoredResultDamaged, decode_result, stored_result
from gateway.errors import RETRY_AFTER_S, ApiError


class _Missing(Exception):
    """The object a record names is not in the bucket."""


class ResultReader:
    def __init__(self, settings: ServiceSettings) -> None:
        self._settings = settings
        self._client: Any = None
        self._client_lock = threading.Lock()

    async def read(self, job: JobPublic) -> JobPublic:
        """``job`` with its result, read from the object store if its record keeps only a
        reference; an ``ApiError`` if it cannot be read (the job itself is unchanged)."""
        stored = stored_result(job)
        if stored is None:
            return job
        try:
            body = await asyncio.to_thread(self._get, stored)
        except _Missing:
            raise ApiError(
                500,
                ErrorCode.INTERNAL_ERROR,
                f"Job {job.id} succeeded, but its result, kept in the object store as "
                f"{stored.key}, is gone: the bucket must keep results as long as job records "
                "(LORAFLEET_JOB_TTL_S; see the lifecycle rule in the README).",
            ) from None
        except Exception as exc:  # botocore's errors, which this module does not import
            raise ApiError(
                503,
                ErrorCode.SERVICE_UNAVAILABLE,
                f"Job {job.id} succeeded, but the object store holding its result is "
                f"unreachable ({type(exc).__name__}); retry.",
                headers={"Retry-After": str(RETRY_AFTER_S)},
            ) from exc
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
        try:
            reply = client.get_object(Bucket=self._settings.s3_bucket, Key=stored.key)
        except client.exceptions.NoSuchKey:
            raise _Missing from None
        body: bytes = reply["Body"].read()
        return body

    def _s3(self) -> Any:
        with self._client_lock:
            if self._client is None:
                import boto3
                from botocore.config import Config

                settings = self._settings
                self._client = boto3.client(
                    "s3",
                    endpoint_url=settings.s3_endpoint_url,
                    region_name=settings.s3_region,
                    config=Config(
                        retries={"max_attempts": settings.s3_max_attempts, "mode": "standard"},
                        connect_timeout=5,
                        read_timeout=30,
                    ),
                )
            return self._client
