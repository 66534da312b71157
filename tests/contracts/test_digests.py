from __future__ import annotations

from pathlib import Path

from contracts.digests import FileEntry, Manifest, manifest_of, short
from contracts.storage import blob_key, manifest_key


def _write(directory: Path, files: dict[str, bytes]) -> None:
    directory.mkdir(parents=True, exist_ok=True)
    for name, data in files.items():
        (directory / name).write_bytes(data)


def test_digest_is_independent_of_file_order_and_location(tmp_path: Path) -> None:
    _write(tmp_path / "a", {"x.json": b"{}", "w.safetensors": b"weights"})
    _write(tmp_path / "b", {"w.safetensors": b"weights", "x.json": b"{}"})
    assert manifest_of(tmp_path / "a").digest() == manifest_of(tmp_path / "b").digest()
    reordered = Manifest(files=tuple(reversed(manifest_of(tmp_path / "a").files)))
    assert reordered.digest() == manifest_of(tmp_path / "a").digest()


def test_digest_changes_with_one_byte_or_a_rename(tmp_path: Path) -> None:
    _write(tmp_path / "a", {"x.json": b"{}", "w.safetensors": b"weights"})
    _write(tmp_path / "b", {"x.json": b"{}", "w.safetensors": b"weightz"})
    _write(tmp_path / "c", {"y.json": b"{}", "w.safetensors": b"weights"})
    digests = {manifest_of(tmp_path / name).digest() for name in "abc"}
    assert len(digests) == 3


def test_manifest_records_sizes_and_restricts_to_names(tmp_path: Path) -> None:
    _write(tmp_path, {"x.json": b"{}", "w.safetensors": b"12345", "README.md": b"ignored"})
    manifest = manifest_of(tmp_path, ["x.json", "w.safetensors"])
    assert [entry.path for entry in manifest.files] == ["w.safetensors", "x.json"]
    assert manifest.size_bytes == 7
    assert manifest.digest().startswith("sha256:") and len(manifest.digest()) == 71


def test_storage_keys_derive_from_digests_only() -> None:
    entry = FileEntry(path="w.safetensors", sha256="ab" * 32, size_bytes=1)
    assert blob_key(entry.sha256) == f"blobs/sha256/{'ab' * 32}"
    digest = Manifest(files=(entry,)).digest()
    assert manifest_key(digest) == f"manifests/sha256/{digest.removeprefix('sha256:')}.json"
    assert short(digest) == digest.removeprefix("sha256:")[:12]
