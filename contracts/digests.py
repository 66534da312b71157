"""Content digests: how an adapter or a base model is named by its bytes.

A directory's digest is the sha256 of its canonical manifest (sorted paths with each file's
sha256 and size), so two parties agree on identity from the files alone.
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Iterable
from pathlib import Path

from pydantic import BaseModel, ConfigDict

CHUNK_BYTES = 1 << 20
DIGEST_PREFIX = "sha256:"


class FileEntry(BaseModel):
    """One file of an artifact: relative path, sha256 hex of its bytes, size in bytes."""

    model_config = ConfigDict(frozen=True)

    path: str
    sha256: str
    size_bytes: int


class Manifest(BaseModel):
    """The files of an artifact; its canonical JSON is what the digest covers."""

    model_config = ConfigDict(frozen=True)

    files: tuple[FileEntry, ...]

    def canonical_bytes(self) -> bytes:
        """Deterministic serialisation: files sorted by path, compact JSON, UTF-8."""
        ordered = sorted(self.files, key=lambda entry: entry.path)
        payload = {"files": [entry.model_dump() for entry in ordered]}
        return json.dumps(payload, sort_keys=True, separators=(",", ":")).encode()

    def digest(self) -> str:
        """``sha256:<hex>`` of the canonical manifest."""
        return DIGEST_PREFIX + hashlib.sha256(self.canonical_bytes()).hexdigest()

    @property
    def size_bytes(self) -> int:
        """Total size of the artifact's files."""
        return sum(entry.size_bytes for entry in self.files)


def sha256_file(path: Path) -> str:
    """Hex sha256 of a file, read in 1 MiB chunks."""
    digest = hashlib.sha256()
    with path.open("rb") as handle:
        while chunk := handle.read(CHUNK_BYTES):
            digest.update(chunk)
    return digest.hexdigest()


def manifest_of(directory: Path, names: Iterable[str] | None = None) -> Manifest:
    """Manifest of ``directory`` (every regular file below it unless ``names`` restricts it)."""
    if names is None:
        paths = sorted(p for p in directory.rglob("*") if p.is_file())
    else:
        paths = sorted(directory / name for name in names)
    entries = tuple(
        FileEntry(
            path=path.relative_to(directory).as_posix(),
            sha256=sha256_file(path),
            size_bytes=path.stat().st_size,
        )
        for path in paths
    )
    return Manifest(files=entries)


def short(digest: str, length: int = 12) -> str:
    """The first ``length`` hex characters of a ``sha256:`` digest, for names and logs."""
    return digest.removeprefix(DIGEST_PREFIX)[:length]
