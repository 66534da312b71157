"""S3 -> disk cache against a real S3 protocol server (moto over HTTP)."""

from __future__ import annotations

import socket
import threading
import time
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import boto3
import pytest
from botocore.config import Config
from urllib3.exceptions import ProtocolError

from contracts.digests import manifest_of
from contracts.errors import ErrorCode
from contracts.storage import blob_key, manifest_key
from lorafleet.processes import free_port
from lorafleet.publish import upload_artifact
from lorafleet.soak.faults import TcpProxy
from lorafleet.stack import LOCAL_AWS, LocalStack
from lorafleet.validation import ADAPTER_FILES
from worker.adapter_cache import AdapterCache, NoRoom
from worker.errors import (
    AdapterIntegrityError,
    AdapterUnavailableError,
    JobFailure,
    JobStopped,
    StopReason,
)
from worker.inflight import Running

BOUND = 10 * 1024 * 1024


class CountingS3:
    """Passes calls through to boto3 and counts ``get_object`` per key."""

    def __init__(self, client: Any) -> None:
        self._client = client
        self._lock = threading.Lock()
        self.gets: dict[str, int] = {}

    def get_object(self, **kwargs: Any) -> Any:
        with self._lock:
            self.gets[kwargs["Key"]] = self.gets.get(kwargs["Key"], 0) + 1
        return self._client.get_object(**kwargs)


def _artifact(tmp_path: Path, name: str, payload: bytes) -> Path:
    directory = tmp_path / name
    directory.mkdir()
    (directory / "adapter_config.json").write_text('{"peft_type": "LORA", "r": 8}')
    (directory / "adapter_model.safetensors").write_bytes(payload)
    return directory


def _publish(s3: Any, bucket: str, directory: Path) -> str:
    manifest = manifest_of(directory, ADAPTER_FILES)
    upload_artifact(s3, bucket, directory, manifest)
    return manifest.digest()


def _leftovers(root: Path) -> list[Path]:
    return [p for p in (root / "tmp").rglob("*")] + [p for p in (root / "adapters").rglob("*")]


def test_fetch_writes_verified_files_and_times_phases(
    infra: LocalStack, s3: Any, tmp_path: Path
) -> None:
    bucket = infra.settings.s3_bucket
    digest = _publish(s3, bucket, _artifact(tmp_path, "ok", b"weights-ok" * 1000))
    cache = AdapterCache(tmp_path / "cache", s3, bucket, max_bytes=BOUND)
    assert not cache.has(digest)
    fetched = cache.ensure(digest)
    assert fetched.loaded_digest == digest
    assert fetched.fetch_ms is not None and fetched.verify_ms is not None
    assert manifest_of(fetched.path).digest() == digest
    assert cache.has(digest)
    again = cache.ensure(digest)
    assert again.loaded_digest is None and again.fetch_ms is None
    assert cache.verify(digest)[0] == digest
    assert list((tmp_path / "cache" / "tmp").iterdir()) == []


def test_concurrent_requests_for_one_digest_download_once(
    infra: LocalStack, s3: Any, tmp_path: Path
) -> None:
    bucket = infra.settings.s3_bucket
    payload = b"concurrent" * 100_000
    digest = _publish(s3, bucket, _artifact(tmp_path, "conc", payload))
    counting = CountingS3(s3)
    cache = AdapterCache(tmp_path / "cache", counting, bucket, max_bytes=BOUND)
    with ThreadPoolExecutor(16) as pool:
        results = list(pool.map(lambda _: cache.ensure(digest), range(16)))
    weights_key = blob_key(manifest_of(tmp_path / "conc", ADAPTER_FILES).files[1].sha256)
    assert counting.gets[weights_key] == 1
    # One job downloaded (and timed it); the others waited for it and share its verdict,
    # or came once it was on disk (to be verified there).
    assert sum(1 for r in results if r.fetch_ms is not None) == 1
    assert {r.loaded_digest for r in results} <= {digest, None}


def test_tampered_blob_fails_closed_and_leaves_nothing(
    infra: LocalStack, s3: Any, tmp_path: Path
) -> None:
    bucket = infra.settings.s3_bucket
    directory = _artifact(tmp_path, "tamper", b"original-weights" * 100)
    digest = _publish(s3, bucket, directory)
    weights = manifest_of(directory, ADAPTER_FILES).files[1]
    s3.put_object(Bucket=bucket, Key=blob_key(weights.sha256), Body=b"evil-weights" * 100)
    cache = AdapterCache(tmp_path / "cache", s3, bucket, max_bytes=BOUND)
    with pytest.raises(AdapterIntegrityError) as caught:
        cache.ensure(digest)
    assert caught.value.code == "adapter_integrity"
    assert "adapter_model.safetensors" in caught.value.message
    assert not cache.has(digest)
    assert _leftovers(tmp_path / "cache") == []


def test_missing_object_is_adapter_unavailable(infra: LocalStack, s3: Any, tmp_path: Path) -> None:
    cache = AdapterCache(tmp_path / "cache", s3, infra.settings.s3_bucket, max_bytes=BOUND)
    with pytest.raises(AdapterUnavailableError) as caught:
        cache.ensure("sha256:" + "0" * 64)
    assert caught.value.code == "adapter_unavailable"
    assert _leftovers(tmp_path / "cache") == []


def test_unreachable_store_is_adapter_unavailable(tmp_path: Path) -> None:
    client = boto3.client(
        "s3",
        endpoint_url=f"http://127.0.0.1:{free_port()}",
        region_name="us-east-1",
        aws_access_key_id="x",
        aws_secret_access_key="x",
        config=Config(retries={"max_attempts": 1}, connect_timeout=1),
    )
    cache = AdapterCache(tmp_path / "cache", client, "bucket", max_bytes=BOUND)
    with pytest.raises(AdapterUnavailableError):
        cache.ensure("sha256:" + "1" * 64)
    assert _leftovers(tmp_path / "cache") == []


@pytest.fixture
def proxy(infra: LocalStack) -> Iterator[TcpProxy]:
    """A TCP proxy in front of the moto server: ``down()`` is an S3 outage."""
    port = int(infra.s3_endpoint_url.rsplit(":", 1)[1])
    proxy = TcpProxy(("127.0.0.1", port))
    proxy.up()
    yield proxy
    proxy.down()


def _cache_in_outage(
    infra: LocalStack, s3: Any, tmp_path: Path, proxy: TcpProxy, name: str
) -> tuple[AdapterCache, str]:
    """A cache whose S3 is reached through ``proxy``, and an adapter published there; the
    proxy is down when it returns."""
    bucket = infra.settings.s3_bucket
    digest = _publish(s3, bucket, _artifact(tmp_path, name, name.encode() * 100))
    client = boto3.client(
        "s3",
        endpoint_url=f"http://127.0.0.1:{proxy.port}",
        region_name="us-east-1",
        aws_access_key_id=LOCAL_AWS["AWS_ACCESS_KEY_ID"],
        aws_secret_access_key=LOCAL_AWS["AWS_SECRET_ACCESS_KEY"],
        config=Config(retries={"max_attempts": 1}, connect_timeout=1),
    )
    proxy.down()
    return AdapterCache(tmp_path / "cache", client, bucket, BOUND), digest


def test_a_short_store_outage_is_waited_out_within_the_jobs_deadline(
    infra: LocalStack, s3: Any, tmp_path: Path, proxy: TcpProxy
) -> None:
    cache, digest = _cache_in_outage(infra, s3, tmp_path, proxy, "outage")
    with ThreadPoolExecutor(1) as pool:
        # With a check, as a job waits: the pauses between asks call it too.
        waiting = pool.submit(cache.ensure, digest, time.time() + 60, lambda: None)
        time.sleep(2.0)  # some asks refused meanwhile
        assert not waiting.done()
        proxy.up(retry_s=10)
        fetched = waiting.result(timeout=30)
    assert fetched.loaded_digest == digest and cache.has(digest)
    assert list((tmp_path / "cache" / "tmp").iterdir()) == []  # nothing half-written


def test_a_store_outage_longer_than_the_deadline_fails_the_job_adapter_unavailable(
    infra: LocalStack, s3: Any, tmp_path: Path, proxy: TcpProxy
) -> None:
    cache, digest = _cache_in_outage(infra, s3, tmp_path, proxy, "long-outage")
    with pytest.raises(AdapterUnavailableError) as caught:
        cache.ensure(digest, deadline_at=time.time() + 3)
    assert caught.value.code == "adapter_unavailable"
    assert "unreachable" in caught.value.message and "asked" in caught.value.message
    assert not cache.has(digest) and _leftovers(tmp_path / "cache") == []


def test_an_outage_whose_deadline_comes_during_an_ask_fails_adapter_unavailable(
    infra: LocalStack, s3: Any, tmp_path: Path, proxy: TcpProxy, caplog: pytest.LogCaptureFixture
) -> None:
    """The same outage fails the job the same way wherever its deadline falls: during a pause
    between asks, or during an ask (CI saw the latter on a loaded machine, and the job failed
    ``deadline_exceeded`` with no word of the store). Here the first ask is refused and the
    next one hangs (a listener that accepts and never answers) past the deadline."""
    cache, digest = _cache_in_outage(infra, s3, tmp_path, proxy, "hung-ask")
    silent = socket.socket()
    silent.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    try:
        with ThreadPoolExecutor(1) as pool:
            waiting = pool.submit(cache.ensure, digest, time.time() + 8)
            bound = time.monotonic() + 30
            while not any("asking again" in r.getMessage() for r in caplog.records):
                assert time.monotonic() < bound and not waiting.done(), "no refused ask"
                time.sleep(0.01)
            silent.bind(("127.0.0.1", proxy.port))
            silent.listen(8)  # accepts; never answers
            with pytest.raises(AdapterUnavailableError) as caught:
                waiting.result(timeout=60)
    finally:
        silent.close()
    assert caught.value.code == "adapter_unavailable"
    assert "unreachable" in caught.value.message and "asked" in caught.value.message
    assert not cache.has(digest) and _leftovers(tmp_path / "cache") == []


def test_a_stopped_job_stops_waiting_out_an_outage(
    infra: LocalStack, s3: Any, tmp_path: Path, proxy: TcpProxy
) -> None:
    cache, digest = _cache_in_outage(infra, s3, tmp_path, proxy, "stopped")
    stop_at = time.monotonic() + 1.5

    def check() -> None:
        if time.monotonic() > stop_at:
            raise JobStopped(StopReason.CANCELLED)

    with pytest.raises(JobStopped):
        cache.ensure(digest, deadline_at=time.time() + 60, check=check)


def test_tampered_disk_copy_is_quarantined_on_verify(
    infra: LocalStack, s3: Any, tmp_path: Path
) -> None:
    bucket = infra.settings.s3_bucket
    digest = _publish(s3, bucket, _artifact(tmp_path, "disk", b"disk-weights" * 100))
    cache = AdapterCache(tmp_path / "cache", s3, bucket, max_bytes=BOUND)
    path = cache.ensure(digest).path
    (path / "adapter_model.safetensors").write_bytes(b"flipped")
    with pytest.raises(AdapterIntegrityError):
        cache.verify(digest)
    assert not cache.has(digest)
    assert not path.exists()
    assert list((tmp_path / "cache" / "quarantine").iterdir()) == []  # nobody held it


def test_quarantined_entry_is_deleted_only_when_its_last_holder_lets_go(
    infra: LocalStack, s3: Any, tmp_path: Path
) -> None:
    """Two jobs hold an adapter; its disk copy rots. The job that notices must not delete
    files the other one was handed: they are moved aside, new jobs fetch a fresh verified
    copy, and the bad one goes once both jobs are done."""
    bucket = infra.settings.s3_bucket
    digest = _publish(s3, bucket, _artifact(tmp_path, "rot", b"rot-weights" * 100))
    counting = CountingS3(s3)
    cache = AdapterCache(tmp_path / "cache", counting, bucket, max_bytes=BOUND)
    quarantine = tmp_path / "cache" / "quarantine"
    with cache.hold(digest), cache.hold(digest):
        path = cache.ensure(digest).path
        (path / "adapter_model.safetensors").write_bytes(b"rotten")
        with pytest.raises(AdapterIntegrityError) as caught:
            cache.verify(digest)
        assert "quarantined" in caught.value.message
        assert not cache.has(digest)
        (kept,) = quarantine.iterdir()
        assert (kept / "adapter_model.safetensors").read_bytes() == b"rotten"
        fresh = cache.ensure(digest)  # a new job: downloaded again, verified as it streamed
        assert fresh.loaded_digest == digest
        assert cache.verify(digest)[0] == digest
        weights = manifest_of(tmp_path / "rot", ADAPTER_FILES).files[1]
        assert counting.gets[blob_key(weights.sha256)] == 2
        assert kept.exists()
    assert list(quarantine.iterdir()) == []
    assert cache.has(digest)


def test_waiting_for_disk_space_ends_at_the_job_deadline(
    infra: LocalStack, s3: Any, tmp_path: Path
) -> None:
    bucket = infra.settings.s3_bucket
    first = _publish(s3, bucket, _artifact(tmp_path, "holds", b"h" * 40_000))
    second = _publish(s3, bucket, _artifact(tmp_path, "late", b"l" * 40_000))
    size = manifest_of(tmp_path / "holds", ADAPTER_FILES).size_bytes
    cache = AdapterCache(tmp_path / "cache", s3, bucket, max_bytes=size + 10, wait_s=2)
    with cache.hold(first):
        cache.ensure(first)
        with pytest.raises(JobFailure) as caught:
            cache.ensure(second, deadline_at=time.time() + 0.5)
        assert caught.value.code == ErrorCode.DEADLINE_EXCEEDED  # at 0.5 s, not 2 s
        assert "download" in caught.value.message
        with pytest.raises(AdapterUnavailableError):  # the download itself gives up at 2 s
            cache.ensure(second)
    assert not cache.has(second)
    assert list((tmp_path / "cache" / "tmp").iterdir()) == []
    assert not cache.path_for(second).exists()


class SlowS3(CountingS3):
    """An object store that takes ``delay_s`` to start each answer."""

    def __init__(self, client: Any, delay_s: float, held: threading.Event | None = None) -> None:
        super().__init__(client)
        self.delay_s = delay_s
        self.held = held  # given: no answer starts before it is set

    def get_object(self, **kwargs: Any) -> Any:
        time.sleep(self.delay_s)
        if self.held is not None:
            assert self.held.wait(60), "the test never let the download go on"
        return super().get_object(**kwargs)


def test_a_slow_download_fails_its_waiters_at_their_deadline_and_still_lands(
    infra: LocalStack, s3: Any, tmp_path: Path
) -> None:
    """Jobs waiting for one download each give up at their own deadline; the download goes
    on (it was not theirs alone) and the next job finds the adapter on disk."""
    bucket = infra.settings.s3_bucket
    digest = _publish(s3, bucket, _artifact(tmp_path, "slow", b"s" * 1000))
    slow = SlowS3(s3, delay_s=0.5)  # manifest, then the two files: ~1.5 s in all
    cache = AdapterCache(tmp_path / "cache", slow, bucket, max_bytes=BOUND)
    with ThreadPoolExecutor(4) as pool:
        waits = [
            pool.submit(cache.ensure, digest, time.time() + budget) for budget in (0.2, 0.4, 30)
        ]
        outcomes = []
        for wait in waits:
            try:
                outcomes.append(wait.result().loaded_digest)
            except JobFailure as failure:
                outcomes.append(failure.code)
    assert outcomes == [ErrorCode.DEADLINE_EXCEEDED, ErrorCode.DEADLINE_EXCEEDED, digest]
    assert sum(slow.gets.values()) == 3  # one download for all three jobs
    assert cache.ensure(digest, time.time() + 0.1).loaded_digest is None  # on disk now
    assert cache.verify(digest)[0] == digest


def test_a_job_stopped_while_it_waits_for_a_download_leaves_the_wait_at_once(
    infra: LocalStack, s3: Any, tmp_path: Path
) -> None:
    """Its engine died (or the worker drains): a job waiting for a shared download must be
    handed back now, not at its deadline minutes later; the download goes on for the rest."""
    bucket = infra.settings.s3_bucket
    digest = _publish(s3, bucket, _artifact(tmp_path, "stopped", b"t" * 1000))
    downloading = threading.Event()
    slow = SlowS3(s3, delay_s=0.1, held=downloading)  # under way until the test says
    cache = AdapterCache(tmp_path / "cache", slow, bucket, max_bytes=BOUND)
    running = Running("job", attempt=1)
    with ThreadPoolExecutor(2) as pool:
        try:
            stopped = pool.submit(cache.ensure, digest, time.time() + 600, running.check)
            other = pool.submit(cache.ensure, digest, time.time() + 600)
            time.sleep(0.2)
            running.stop(StopReason.ENGINE_FAILED)
            with pytest.raises(JobStopped) as raised:
                # At once: the download is held until after this (a wait that ignored the
                # stop would last until the job's deadline, ten minutes away).
                stopped.result(timeout=30)
            assert raised.value.reason == StopReason.ENGINE_FAILED
            assert not other.done()  # the download goes on for the others
        finally:
            downloading.set()
        assert other.result().loaded_digest == digest
    assert sum(slow.gets.values()) == 3


def test_stray_directory_where_an_entry_goes_is_replaced_not_trusted(
    infra: LocalStack, s3: Any, tmp_path: Path
) -> None:
    """Left by a process that shared the cache directory, or by a crash: a directory already
    where the verified download is renamed to. It is not ours; it is not trusted."""
    bucket = infra.settings.s3_bucket
    digest = _publish(s3, bucket, _artifact(tmp_path, "stray", b"real" * 500))
    cache = AdapterCache(tmp_path / "cache", s3, bucket, max_bytes=BOUND)
    stray = cache.path_for(digest)
    stray.mkdir()
    (stray / "adapter_model.safetensors").write_bytes(b"not these")
    fetched = cache.ensure(digest)
    assert fetched.loaded_digest == digest
    assert cache.verify(digest)[0] == digest
    assert list((tmp_path / "cache" / "quarantine").iterdir()) == []


def test_a_cache_that_cannot_be_written_fails_the_download_cleanly(
    infra: LocalStack, s3: Any, tmp_path: Path
) -> None:
    bucket = infra.settings.s3_bucket
    digest = _publish(s3, bucket, _artifact(tmp_path, "ro", b"x" * 500))
    cache = AdapterCache(tmp_path / "cache", s3, bucket, max_bytes=BOUND)
    tmp = tmp_path / "cache" / "tmp"
    tmp.rmdir()
    tmp.write_text("a file where the download directory should be")  # as a full disk would
    with pytest.raises(AdapterUnavailableError) as caught:
        cache.ensure(digest)
    assert "disk cache" in caught.value.message
    assert not cache.has(digest)
    assert cache.used_bytes() == 0


def test_byte_bound_evicts_least_recently_used_unheld_entries(
    infra: LocalStack, s3: Any, tmp_path: Path
) -> None:
    bucket = infra.settings.s3_bucket
    digests = [
        _publish(s3, bucket, _artifact(tmp_path, f"lru{i}", bytes([i]) * 40_000)) for i in range(4)
    ]
    size = manifest_of(tmp_path / "lru0", ADAPTER_FILES).size_bytes
    cache = AdapterCache(tmp_path / "cache", s3, bucket, max_bytes=3 * size, wait_s=0.5)
    for digest in digests[:3]:
        cache.ensure(digest)
    cache.ensure(digests[0])  # touch: digests[1] is now the least recently used
    with cache.hold(digests[1]):
        cache.ensure(digests[3])  # needs room: digests[1] is held, so digests[2] goes
        assert cache.has(digests[1]) and not cache.has(digests[2])
    assert cache.has(digests[0]) and cache.has(digests[3])
    assert cache.used_bytes() <= cache.max_bytes
    assert not cache.path_for(digests[2]).exists()


def test_full_cache_of_held_entries_refuses_instead_of_overflowing(
    infra: LocalStack, s3: Any, tmp_path: Path
) -> None:
    bucket = infra.settings.s3_bucket
    first = _publish(s3, bucket, _artifact(tmp_path, "held", b"h" * 40_000))
    second = _publish(s3, bucket, _artifact(tmp_path, "wants", b"w" * 40_000))
    size = manifest_of(tmp_path / "held", ADAPTER_FILES).size_bytes
    cache = AdapterCache(tmp_path / "cache", s3, bucket, max_bytes=size + 10, wait_s=0.2)
    with cache.hold(first):
        cache.ensure(first)
        with pytest.raises(AdapterUnavailableError) as caught:
            cache.ensure(second)
    assert "in use" in caught.value.message
    assert not cache.has(second)
    assert list((tmp_path / "cache" / "tmp").iterdir()) == []
    too_big = AdapterCache(tmp_path / "small", s3, bucket, max_bytes=100)
    with pytest.raises(AdapterUnavailableError):
        too_big.ensure(second)
    assert _leftovers(tmp_path / "small") == []


def test_restart_adopts_complete_entries_and_drops_partial_downloads(
    infra: LocalStack, s3: Any, tmp_path: Path
) -> None:
    bucket = infra.settings.s3_bucket
    digest = _publish(s3, bucket, _artifact(tmp_path, "adopt", b"a" * 1000))
    AdapterCache(tmp_path / "cache", s3, bucket, max_bytes=BOUND).ensure(digest)
    partial = tmp_path / "cache" / "tmp" / "deadbeef.partial"
    partial.mkdir()
    (partial / "adapter_model.safetensors").write_bytes(b"half")
    restarted = AdapterCache(tmp_path / "cache", s3, bucket, max_bytes=BOUND)
    assert restarted.has(digest)
    assert restarted.verify(digest)[0] == digest
    assert not partial.exists()


class _BreaksOnce:
    """Real S3 client whose first body read of ``key`` fails mid-stream (a dropped link)."""

    def __init__(self, client: Any, key: str) -> None:
        self._client = client
        self._key = key
        self.broken = 0

    def get_object(self, **kwargs: Any) -> Any:
        response = self._client.get_object(**kwargs)
        if kwargs["Key"] == self._key and not self.broken:
            self.broken += 1
            real = response["Body"]

            class Body:
                def iter_chunks(self, size: int) -> Any:
                    yield real.read(size)
                    raise ProtocolError("Connection broken: IncompleteRead")

            response["Body"] = Body()
        return response


def test_a_body_that_breaks_mid_stream_is_fetched_again(
    infra: LocalStack, s3: Any, tmp_path: Path
) -> None:
    bucket = infra.settings.s3_bucket
    directory = _artifact(tmp_path, "flaky", b"flaky-weights" * 200_000)
    digest = _publish(s3, bucket, directory)
    weights = blob_key(manifest_of(directory, ADAPTER_FILES).files[1].sha256)
    flaky = _BreaksOnce(s3, weights)
    cache = AdapterCache(tmp_path / "cache", flaky, bucket, max_bytes=BOUND)
    assert cache.ensure(digest).loaded_digest == digest
    assert flaky.broken == 1


def test_object_larger_than_its_manifest_is_cut_off_and_refused(
    infra: LocalStack, s3: Any, tmp_path: Path
) -> None:
    bucket = infra.settings.s3_bucket
    directory = _artifact(tmp_path, "grown", b"small" * 100)
    digest = _publish(s3, bucket, directory)
    weights = manifest_of(directory, ADAPTER_FILES).files[1]
    s3.put_object(Bucket=bucket, Key=blob_key(weights.sha256), Body=b"x" * 3_000_000)
    cache = AdapterCache(tmp_path / "cache", s3, bucket, max_bytes=BOUND)
    with pytest.raises(AdapterIntegrityError) as caught:
        cache.ensure(digest)
    assert "larger than its manifest" in caught.value.message
    assert _leftovers(tmp_path / "cache") == []


def _three(s3: Any, bucket: str, tmp_path: Path, tag: str) -> tuple[list[str], int]:
    digests = [
        _publish(s3, bucket, _artifact(tmp_path, f"{tag}-{n}", bytes([65 + n]) * 20_000))
        for n in range(3)
    ]
    return digests, manifest_of(tmp_path / f"{tag}-0", ADAPTER_FILES).size_bytes


@pytest.mark.parametrize("policy", ["lru", "cost"])
def test_cost_eviction_keeps_the_adapter_asked_for_most_and_lru_the_one_used_last(
    infra: LocalStack, s3: Any, tmp_path: Path, policy: str
) -> None:
    """Room for two of three equal adapters. A was fetched first and asked for 20 times, B
    once, later: a third download evicts A under LRU (least recently used) and B under the
    cost policy (requests x fetch time per byte: B's is a twentieth of A's, A's fetch, the
    first of the process, being no faster than B's)."""
    bucket = infra.settings.s3_bucket
    (a, b, c), size = _three(s3, bucket, tmp_path, policy)
    cache = AdapterCache(
        tmp_path / "cache",
        s3,
        bucket,
        max_bytes=2 * size + 10,
        policy=policy,  # type: ignore[arg-type]
    )
    cache.ensure(a)
    for _ in range(19):
        cache.ensure(a)
    cache.ensure(b)
    cache.ensure(c)
    kept = {d for d in (a, b) if cache.has(d)}
    assert kept == ({b} if policy == "lru" else {a})
    assert cache.has(c)


def test_a_prefetch_makes_room_only_from_what_no_job_holds_or_wants(
    infra: LocalStack, s3: Any, tmp_path: Path
) -> None:
    bucket = infra.settings.s3_bucket
    (a, b, c), size = _three(s3, bucket, tmp_path, "room")
    cache = AdapterCache(tmp_path / "cache", s3, bucket, max_bytes=size + 10)
    cache.ensure(a)
    with cache.hold(a), pytest.raises(NoRoom):  # a running job holds A
        cache.prefetch(b, frozenset())
    with pytest.raises(NoRoom):  # a waiting job wants A
        cache.prefetch(b, frozenset({a, b}))
    assert cache.has(a) and not cache.has(b)
    assert list((tmp_path / "cache" / "tmp").iterdir()) == []
    fetched = cache.prefetch(b, frozenset({b, c}))
    assert fetched is not None and fetched.loaded_digest == b
    assert cache.has(b) and not cache.has(a)
    assert cache.prefetch(b, frozenset()) is None  # on disk already: nothing to do


def test_a_job_that_joins_a_prefetch_which_finds_no_room_downloads_its_adapter_itself(
    infra: LocalStack, s3: Any, tmp_path: Path
) -> None:
    """A job asks for B while a prefetch of B is under way; the prefetch gives up (the only
    entry it could evict is wanted by a waiting job): the job is not failed for that, it
    downloads B on its own, evicting what a job may."""
    bucket = infra.settings.s3_bucket
    (a, b, _), size = _three(s3, bucket, tmp_path, "join")
    slow = SlowS3(s3, delay_s=0.3)
    cache = AdapterCache(tmp_path / "cache", slow, bucket, max_bytes=size + 10)
    cache.ensure(a)
    with ThreadPoolExecutor(2) as pool:
        prefetch = pool.submit(cache.prefetch, b, frozenset({a}))
        time.sleep(0.1)  # the prefetch is reading B's manifest
        job = pool.submit(cache.ensure, b, time.time() + 60)
        with pytest.raises(NoRoom):
            prefetch.result()
        assert job.result().loaded_digest == b
    assert cache.has(b) and not cache.has(a)


def test_a_tampered_prefetch_fails_verification_and_keeps_nothing(
    infra: LocalStack, s3: Any, tmp_path: Path
) -> None:
    bucket = infra.settings.s3_bucket
    directory = _artifact(tmp_path, "tampered-prefetch", b"good-weights" * 100)
    digest = _publish(s3, bucket, directory)
    weights = manifest_of(directory, ADAPTER_FILES).files[1]
    s3.put_object(Bucket=bucket, Key=blob_key(weights.sha256), Body=b"evil-weights" * 100)
    evicted: list[str] = []
    cache = AdapterCache(tmp_path / "cache", s3, bucket, max_bytes=BOUND)
    cache.on_evict = evicted.append
    with pytest.raises(AdapterIntegrityError):
        cache.prefetch(digest, frozenset())
    assert not cache.has(digest) and _leftovers(tmp_path / "cache") == []
    with pytest.raises(AdapterIntegrityError):  # its job fails the same way, on its own fetch
        cache.ensure(digest)
    assert evicted == []


def test_requests_that_failed_to_fetch_still_count_in_the_adapters_request_rate(
    infra: LocalStack, s3: Any, tmp_path: Path
) -> None:
    """An adapter asked for twenty times while its object could not be fetched, then once
    with success, was asked for 21 times: it outweighs one asked for twice when a third
    needs the room (a failed fetch must not wipe the history eviction weighs). Cost weighs
    the square root of a timed fetch: only a fetch of b over 100 times slower than a's could
    turn this round."""
    bucket = infra.settings.s3_bucket
    (a, b, c), size = _three(s3, bucket, tmp_path, "failed")
    s3.delete_object(Bucket=bucket, Key=manifest_key(a))  # not there: each ask fails at once
    cache = AdapterCache(tmp_path / "cache", s3, bucket, max_bytes=2 * size + 10, policy="cost")
    for _ in range(20):
        with pytest.raises(AdapterUnavailableError):
            cache.ensure(a)
    _publish(s3, bucket, tmp_path / "failed-0")
    cache.ensure(a)
    for _ in range(2):
        cache.ensure(b)
    cache.ensure(c)
    assert cache.has(a) and not cache.has(b) and cache.has(c)
