"""Publish an adapter: upload its files content-addressed to S3, then register its alias."""

from __future__ import annotations

import json
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

from botocore.exceptions import ClientError
from redis import Redis

from contracts.digests import Manifest, manifest_of
from contracts.keys import ADAPTERS_INDEX, adapter_key
from contracts.queues import Tier
from contracts.registry import AdapterRecord, BaseModelRef
from contracts.storage import blob_key, manifest_key

ADAPTER_FILES = ("adapter_config.json", "adapter_model.safetensors")


class PublishError(Exception):
    """Publishing refused; nothing was registered. ``code`` is stable."""

    def __init__(self, code: str, message: str) -> None:
        super().__init__(message)
        self.code = code
        self.message = message


def _read_config(directory: Path) -> dict[str, Any]:
    missing = [name for name in ADAPTER_FILES if not (directory / name).is_file()]
    if missing:
        raise PublishError("adapter_invalid", f"{directory} lacks {', '.join(missing)}.")
    config: dict[str, Any] = json.loads((directory / "adapter_config.json").read_text())
    if config.get("peft_type") != "LORA":
        raise PublishError("adapter_invalid", "adapter_config.json must have peft_type LORA.")
    return config


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


def publish_adapter(
    *,
    directory: Path,
    alias: str,
    tier: Tier,
    base_model: BaseModelRef,
    redis: Redis,
    s3: Any,
    bucket: str,
    owner: str = "default",
) -> AdapterRecord:
    """Publish ``directory`` under ``alias``. Same bytes again is a no-op; other bytes refused."""
    config = _read_config(directory)
    manifest = manifest_of(directory, ADAPTER_FILES)
    digest = manifest.digest()
    existing = redis.get(adapter_key(alias))
    if existing is not None:
        record = AdapterRecord.model_validate_json(existing)
        if record.digest == digest:
            return record
        raise PublishError(
            "alias_exists",
            f"Alias {alias!r} already names {record.digest}; publish new bytes under a new alias.",
        )
    record = AdapterRecord(
        alias=alias,
        digest=digest,
        base_model=base_model,
        rank=int(config["r"]),
        alpha=float(config.get("lora_alpha", config["r"])),
        target_modules=tuple(sorted(config["target_modules"])),
        size_bytes=manifest.size_bytes,
        tier=tier,
        owner=owner,
        created_at=datetime.now(tz=UTC),
    )
    upload_artifact(s3, bucket, directory, manifest)
    if not redis.set(adapter_key(alias), record.model_dump_json(), nx=True):
        raise PublishError("alias_exists", f"Alias {alias!r} was published concurrently.")
    redis.sadd(ADAPTERS_INDEX, alias)
    return record


def list_adapters(redis: Redis) -> list[AdapterRecord]:
    aliases = sorted(str(alias) for alias in redis.smembers(ADAPTERS_INDEX))  # type: ignore[union-attr]
    raws = [redis.get(adapter_key(alias)) for alias in aliases]
    return [AdapterRecord.model_validate_json(str(raw)) for raw in raws if raw is not None]
