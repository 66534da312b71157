"""Cold fetch of a ~100 MB adapter: lorafleet's fetch + verify against a plain boto3 download.

Both read the same object from the same S3 server in one run, alternating, so machine noise
hits both alike. lorafleet hashes while streaming; the target is <= 1.2x the plain download.

    .venv/bin/python benchmarks/cold_fetch.py [--size-mb 100] [--rounds 5]

Uses ``LORAFLEET_S3_ENDPOINT_URL`` if set, otherwise starts a local moto server.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import tempfile
import time
from pathlib import Path
from typing import Any

from rich.console import Console
from rich.table import Table

from contracts.digests import CHUNK_BYTES, manifest_of
from contracts.storage import blob_key
from lorafleet.fixtures import write_fixtures
from lorafleet.publish import upload_artifact
from lorafleet.settings import LocalSettings
from lorafleet.stack import LocalStack
from lorafleet.validation import ADAPTER_FILES
from worker.adapter_cache import AdapterCache


def make_artifact(directory: Path, size_bytes: int) -> Path:
    directory.mkdir(parents=True)
    (directory / "adapter_config.json").write_text(json.dumps({"peft_type": "LORA", "r": 8}))
    with (directory / "adapter_model.safetensors").open("wb") as handle:
        remaining = size_bytes
        while remaining:
            chunk = os.urandom(min(remaining, 8 * CHUNK_BYTES))
            handle.write(chunk)
            remaining -= len(chunk)
    return directory


def plain_get_object(s3: Any, bucket: str, key: str, out: Path) -> None:
    """The obvious boto3 download: stream the body to a file, no hashing."""
    body = s3.get_object(Bucket=bucket, Key=key)["Body"]
    with out.open("wb") as handle:
        for chunk in body.iter_chunks(CHUNK_BYTES):
            handle.write(chunk)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--size-mb", type=int, default=100)
    parser.add_argument("--rounds", type=int, default=5)
    args = parser.parse_args()
    console = Console()
    scratch = Path(tempfile.mkdtemp(prefix="lorafleet-bench-"))
    settings = LocalSettings(state_dir=scratch / "state", s3_bucket="bench")
    write_fixtures(scratch / "fixtures", adapters=1)
    stack = LocalStack(settings, scratch / "fixtures" / "base")
    try:
        stack.start_infra()
        s3 = stack.s3()
        artifact = make_artifact(scratch / "artifact", args.size_mb * 1024 * 1024)
        manifest = manifest_of(artifact, ADAPTER_FILES)
        upload_artifact(s3, "bench", artifact, manifest)
        weights_key = blob_key(manifest.files[1].sha256)
        timings: dict[str, list[float]] = {
            "plain get_object": [],
            "plain download_file": [],
            "lorafleet fetch+verify": [],
        }
        for round_index in range(args.rounds):
            console.print(f"round {round_index + 1}/{args.rounds}")
            out = scratch / f"plain-{round_index}"
            start = time.perf_counter()
            plain_get_object(s3, "bench", weights_key, out)
            timings["plain get_object"].append(time.perf_counter() - start)
            out.unlink()
            start = time.perf_counter()
            s3.download_file("bench", weights_key, str(out))
            timings["plain download_file"].append(time.perf_counter() - start)
            out.unlink()
            cache = AdapterCache(scratch / f"cache-{round_index}", s3, "bench", max_bytes=2**40)
            start = time.perf_counter()
            fetched = cache.ensure(manifest.digest())
            timings["lorafleet fetch+verify"].append(time.perf_counter() - start)
            assert fetched.loaded_digest == manifest.digest()
            shutil.rmtree(scratch / f"cache-{round_index}")
    finally:
        stack.stop()
        shutil.rmtree(scratch, ignore_errors=True)

    baseline = statistics.median(timings["plain get_object"])
    table = Table(title=f"cold fetch of a {args.size_mb} MB adapter ({args.rounds} rounds)")
    for column in ("path", "median s", "MB/s", "ratio to plain get_object"):
        table.add_column(column, justify="left" if column == "path" else "right")
    for name, values in timings.items():
        median = statistics.median(values)
        table.add_row(
            name, f"{median:.3f}", f"{args.size_mb / median:.0f}", f"{median / baseline:.2f}x"
        )
    console.print(table)


if __name__ == "__main__":
    main()
