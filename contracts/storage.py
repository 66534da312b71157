"""Object-store layout: every key derives from a content digest, never from an alias."""

from __future__ import annotations

from contracts.digests import DIGEST_PREFIX


def blob_key(file_sha256: str) -> str:
    """Key of one file's bytes, addressed by the sha256 hex of those bytes."""
    return f"blobs/sha256/{file_sha256}"


def manifest_key(digest: str) -> str:
    """Key of an adapter's canonical manifest, addressed by the adapter digest."""
    return f"manifests/sha256/{digest.removeprefix(DIGEST_PREFIX)}.json"
