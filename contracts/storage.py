"""Object-store layout: every key derives from a content digest, never from an alias."""

from __future__ import annotations

import hashlib
from typing import Any

from contracts.digests import DIGEST_PREFIX
from contracts.jobs import JobPublic, JobResult, StoredResult


def blob_key(file_sha256: str) -> str:
    """Key of one file's bytes, addressed by the sha256 hex of those bytes."""
    return f"blobs/sha256/{file_sha256}"


def manifest_key(digest: str) -> str:
    """Key of an adapter's canonical manifest, addressed by the adapter digest."""
    return f"manifests/sha256/{digest.removeprefix(DIGEST_PREFIX)}.json"


RESULTS_PREFIX = "results/"
"""Where offloaded results live; the bucket's lifecycle rule expires this prefix."""


def result_key(tenant: str, sha256_hex: str) -> str:
    """Key of an offloaded job result: under its tenant, addressed by the sha256 of its bytes
    (two jobs with one result share the object; a write of it again renews its age)."""
    return f"{RESULTS_PREFIX}{tenant}/sha256/{sha256_hex}.json"


def encode_result(tenant: str, result: JobResult) -> tuple[StoredResult, bytes]:
    """The bytes an offloaded result is stored as, and the reference the record keeps."""
    body = result.model_dump_json().encode()
    sha256 = hashlib.sha256(body).hexdigest()
    stored = StoredResult(
        key=result_key(tenant, sha256),
        sha256=sha256,
        size_bytes=len(body),
        finish_reason=result.finish_reason,
        usage=result.usage,
    )
    return stored, body


class StoredResultDamaged(Exception):
    """An offloaded result's bytes are not the ones its record names."""


def decode_result(stored: StoredResult, body: bytes) -> JobResult:
    """The result held in ``body``, read from ``stored.key``, once its digest is checked."""
    got = hashlib.sha256(body).hexdigest()
    if len(body) != stored.size_bytes or got != stored.sha256:
        raise StoredResultDamaged(
            f"the object {stored.key} holds {len(body)} bytes of sha256 {got}, not the "
            f"{stored.size_bytes} bytes of sha256 {stored.sha256} its job's record names"
        )
    return JobResult.model_validate_json(body)


def stored_result(job: JobPublic) -> StoredResult | None:
    """Where ``job``'s result is, when its record keeps only a reference to it."""
    if job.result is not None or job.metadata is None:
        return None
    return job.metadata.result_stored


def gone_or_denied(s3_error: dict[str, Any]) -> bool:
    """Whether an S3 error reply (botocore's ``ClientError.response``) says the object is
    not there (404) or may not be read (403 ``AccessDenied``, also a missing key to a reader
    without ``s3:ListBucket``): asking again cannot mend it. Other 403s (a clock skewed, a
    signature from credentials being rotated) and 5xx can pass."""
    status = s3_error.get("ResponseMetadata", {}).get("HTTPStatusCode")
    code = s3_error.get("Error", {}).get("Code")
    return status == 404 or (status == 403 and code == "AccessDenied")


_MAX_BACKOFF_S = 20.0
"""botocore's cap on the wait before a retry (standard mode)."""
_MAX_RETRY_AFTER_S = 5.0
"""What botocore adds at most to that wait when S3 answers with ``x-amz-retry-after``."""


def longest_call_s(s3_client: Any) -> float:
    """The longest one call of ``s3_client`` can take when S3 stalls: every try connects and
    waits for an answer as long as the client allows, with botocore's wait (at most
    ``2 ** n`` s, capped at 20, plus up to 5 s S3 may ask for) before each retry. Not
    bounded by it: name resolution, and reading a body that trickles in (each read of it
    is bounded, not the whole)."""
    config = s3_client.meta.config
    retries = config.retries or {}
    if "total_max_attempts" in retries:  # what botocore makes of ``max_attempts``
        tries = int(retries["total_max_attempts"])
    else:
        tries = 1 + int(retries.get("max_attempts", 4))  # at least botocore's default
    waits = sum(min(2.0**n, _MAX_BACKOFF_S) + _MAX_RETRY_AFTER_S for n in range(1, tries))
    return tries * (float(config.connect_timeout) + float(config.read_timeout)) + waits
