"""Publish an adapter: validate it, upload it content-addressed to S3, register its alias.

Validation happens before any upload, so a refused adapter leaves nothing in S3 or Redis.
"""

from __future__ import annotations

from datetime import UTC, datetime
from pathlib import Path
from typing import Any

from botocore.exceptions import ClientError

from contracts.digests import Manifest, manifest_of
from contracts.errors import ErrorCode
from contracts.queues import Tier
from contracts.registry import AdapterRecord, BaseModelRef
from contracts.storage import blob_key, manifest_key
from lorafleet.registry import Registry, RegistryError, check_name
from lorafleet.validation import ADAPTER_FILES, Limits, validate_adapter


def _exists(s3: Any, bucket: str, key: str) -> bool:
    try:
        s3.head_object(Bucket=bucket, Key=key)
    except ClientError as exc:
        if exc.response.get("Error", {}).get("Code") in {"404", "NoSuchKey", "NotFound"}:
            return False
        raise
    return True


def upload_artifact(s3: Any, bucket: str, directory: Path, manifest: Manifest) -> None:
    """Upload blobs first and the manifest last, so a visible manifest is always complete."""
    for entry in manifest.files:
        key = blob_key(entry.sha256)
        if not _exists(s3, bucket, key):
            s3.upload_file(str(directory / entry.path), bucket, key)
    s3.put_object(
        Bucket=bucket, Key=manifest_key(manifest.digest()), Body=manifest.canonical_bytes()
    )


class Publisher:
    """Publishes adapters for one fleet: its base model, its limits, its registry and bucket."""

    def __init__(
        self,
        *,
        base_dir: Path,
        base_model_id: str,
        limits: Limits,
        registry: Registry,
        s3: Any,
        bucket: str,
    ) -> None:
        self.base_dir = base_dir
        self.base_model = BaseModelRef(id=base_model_id, digest=manifest_of(base_dir).digest())
        self.limits = limits
        self.registry = registry
        self._s3 = s3
        self._bucket = bucket

    def publish(
        self, directory: Path, alias: str, tier: Tier, owner: str = "default"
    ) -> AdapterRecord:
        """Publish ``directory`` as ``alias``. Same bytes again: no-op; other bytes: refused."""
        check_name(alias, "Alias")
        valid = validate_adapter(directory, self.base_dir, self.base_model.id, self.limits)
        manifest = manifest_of(directory, ADAPTER_FILES)
        digest = manifest.digest()
        existing = self.registry.get(alias)
        if isinstance(existing, AdapterRecord) and existing.digest == digest:
            return existing
        record = AdapterRecord(
            alias=alias,
            digest=digest,
            base_model=self.base_model,
            rank=valid.rank,
            alpha=valid.alpha,
            target_modules=valid.target_modules,
            size_bytes=manifest.size_bytes,
            tier=tier,
            owner=owner,
            created_at=datetime.now(tz=UTC),
        )
        if tier == Tier.HOT and existing is None:  # other bytes under the alias: alias_exists
            self._check_pins(alias, digest)
        if existing is None and self.registry.channel(alias) is None:
            # Content-addressed: an upload can only add correctly-named blobs; it never
            # changes what an existing alias means.
            upload_artifact(self._s3, self._bucket, directory, manifest)
        return self.registry.register(record)

    def _check_pins(self, alias: str, digest: str) -> None:
        """Refuse a hot adapter the live workers of its base model could not pin (before
        anything is uploaded or registered): a worker pins every hot adapter of its base
        model and keeps one GPU slot free for the others."""
        room = self.registry.pin_room(self.base_model.digest)
        if room is None:
            return  # no worker to ask; one that starts pins what fits and says which not
        pins, hot = room
        if len(hot) < pins or digest in hot:
            return
        raise RegistryError(
            ErrorCode.PINS_EXCEED_SLOTS,
            f"{alias!r} would be hot adapter {len(hot) + 1} of base model "
            f"{self.base_model.id}, whose workers pin at most {pins} (LORAFLEET_MAX_LORAS - 1: "
            f"one GPU slot stays free for every other adapter); hot now: "
            f"{', '.join(sorted(hot.values()))}. "
            "Nothing was published. Publish it warm, retire a hot adapter, or give the "
            "workers more slots.",
        )
