"""Local disk cache of adapter artifacts, filled from S3 and verified while streaming.

Layout: ``<root>/adapters/<digest hex>/`` holds exactly the artifact's files. A download goes
to ``<root>/tmp/`` and is renamed into place only after every byte matched the manifest, so a
directory under ``adapters/`` is always complete; a failed fetch leaves nothing behind. An
entry whose files no longer hash to their digest is moved to ``<root>/quarantine/`` at once
(new jobs download it again) and deleted once no job holds it.
"""

from __future__ import annotations

import concurrent.futures
import hashlib
import logging
import math
import os
import queue
import random
import shutil
import threading
import time
import uuid
from collections import Counter, OrderedDict
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal

from botocore.exceptions import BotoCoreError, ClientError
from pydantic import ValidationError
from urllib3.exceptions import HTTPError

from contracts.digests import CHUNK_BYTES, DIGEST_PREFIX, FileEntry, Manifest, manifest_of
from contracts.errors import ErrorCode
from contracts.storage import blob_key, manifest_key
from worker import metrics
from worker.deadlines import CHECK_EVERY_S, late, passed, wait_slice
from worker.errors import AdapterIntegrityError, AdapterUnavailableError, JobFailure

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class Fetched:
    """Where an artifact now lives, and the phases this call observed (ms, None if skipped)."""

    path: Path
    loaded_digest: str | None
    fetch_ms: float | None
    verify_ms: float | None


def _ms(start: float) -> float:
    return round((time.perf_counter() - start) * 1000, 3)


def _missing(error: ClientError) -> bool:
    code = str(error.response.get("Error", {}).get("Code", ""))
    return code in {"NoSuchKey", "404", "NotFound"}


class _StreamBroken(Exception):
    """The connection broke while reading an object's body (worth retrying)."""


class StoreDown(AdapterUnavailableError):
    """The object store did not answer: no connection, one that broke, a 5xx. A job with
    time left before its deadline asks again (``AdapterCache.ensure``); a missing object or a
    refusal (403) is final at once."""


STORE_RETRY_S = 0.5
"""First pause before a job asks an object store that was down again; doubling, jittered."""
STORE_RETRY_MAX_S = 5.0
"""Longest pause between two such asks."""


def _pause(delay_s: float, check: Callable[[], None] | None) -> None:
    """Sleep ``delay_s``, calling ``check`` (which raises once the job is stopped) meanwhile."""
    end = time.monotonic() + delay_s
    while (left := end - time.monotonic()) > 0:
        if check is not None:
            check()
        time.sleep(min(left, CHECK_EVERY_S))


class NoRoom(AdapterUnavailableError):
    """A prefetch found no room without evicting what it may not (never a job's error: a job
    that joined that download starts its own)."""


NO_EVICTION: frozenset[str] = frozenset({"<no eviction>"})
"""``protect`` for a prefetch that may use free room only."""

DEFAULT_FETCH_MS_PER_MB = 20.0
"""The fetch cost assumed for an entry whose fetch this process did not time (found on disk
at start), until one was timed: then the mean per-byte cost of those timed."""


class _HashingWriter:
    """Hashes and writes chunks on a helper thread while the caller keeps reading the network.

    hashlib and file writes release the GIL on large buffers, so verification overlaps the
    download instead of adding to it: one pass over the bytes, little extra wall time.
    """

    def __init__(self, path: Path) -> None:
        self._digest = hashlib.sha256()
        self._handle = path.open("wb")
        self._chunks: queue.Queue[bytes | None] = queue.Queue(maxsize=16)
        self._error: OSError | None = None
        self._thread = threading.Thread(target=self._run, name="sha256-writer", daemon=True)
        self._thread.start()

    def _run(self) -> None:
        try:
            while (chunk := self._chunks.get()) is not None:
                self._digest.update(chunk)
                if self._error is None:
                    self._handle.write(chunk)
        except OSError as exc:  # keep draining so the producer never blocks
            self._error = exc
            while self._chunks.get() is not None:
                pass
        finally:
            self._handle.close()

    def write(self, chunk: bytes) -> None:
        self._chunks.put(chunk)

    def close(self) -> str:
        """Wait for every chunk; returns the sha256 hex digest or raises the write error."""
        if self._thread.is_alive():
            self._chunks.put(None)
            self._thread.join()
        if self._error is not None:
            raise self._error
        return self._digest.hexdigest()


class AdapterCache:
    """S3 -> disk, bounded in bytes, one download per digest however many ask at once.

    A job ``hold``s its adapter from before it is needed until its generation ends; held
    entries are never evicted, so the engine can always (re)load from the path it was given.
    The bound covers finished entries plus downloads in flight (reserved before the first
    byte is written), so the directory never exceeds ``max_bytes``.

    Eviction (``policy``): ``cost`` evicts the unheld entry that costs least to bring back
    per byte it frees: its decayed request rate (jobs asking for it, plus jobs a prefetch
    saw waiting for it: ``expect``) times its fetch time, divided by its size, the least
    recently used first among equals; ``lru`` evicts the least recently used. The fetch
    time is its measured one shrunk toward the mean for its size (``_costs``).
    """

    def __init__(
        self,
        root: Path,
        s3: Any,
        bucket: str,
        max_bytes: int,
        wait_s: float = 60.0,
        stream_attempts: int = 3,
        max_downloads: int = 8,
        policy: Literal["cost", "lru"] = "cost",
        rate_half_life_s: float = 600.0,
    ) -> None:
        self._root = root
        self._stream_attempts = stream_attempts
        self._s3 = s3
        self._bucket = bucket
        self._max_bytes = max_bytes
        self._wait_s = wait_s
        self._cond = threading.Condition()
        self._entries: OrderedDict[str, int] = OrderedDict()  # digest -> bytes, oldest first
        self._holds: Counter[str] = Counter()
        # Quarantined copies of a digest, deleted when its last hold is released.
        self._quarantined: dict[str, list[Path]] = {}
        self._reserved = 0
        # One download per digest at a time; jobs wait for it, each until its own deadline.
        self._downloads: dict[str, concurrent.futures.Future[Fetched]] = {}
        self._fetcher = concurrent.futures.ThreadPoolExecutor(
            max_workers=max_downloads, thread_name_prefix="adapter-download"
        )
        self._policy = policy
        self._decay_s = rate_half_life_s / math.log(2)
        self._rate: dict[str, tuple[float, float]] = {}  # digest -> (requests, as of when)
        self._fetch_ms: dict[str, float] = {}  # digest -> its last timed fetch
        self._prune_at = 0.0
        self.on_change: Callable[[], None] = lambda: None
        """Called (lock held: it must not block) when an adapter arrives or leaves the disk."""
        self.on_evict: Callable[[str], None] = lambda digest: None
        """Called (lock held: it must not block) with a digest evicted or quarantined."""
        self._scan()

    def _scan(self) -> None:
        """Adopt complete entries left by an earlier process; drop partial downloads."""
        for leftover in ("tmp", "quarantine"):
            shutil.rmtree(self._root / leftover, ignore_errors=True)
        (self._root / "tmp").mkdir(parents=True, exist_ok=True)
        adapters = self._root / "adapters"
        adapters.mkdir(parents=True, exist_ok=True)
        found = sorted(adapters.iterdir(), key=lambda p: p.stat().st_mtime)
        for path in found:
            size = sum(f.stat().st_size for f in path.iterdir() if f.is_file())
            self._entries[DIGEST_PREFIX + path.name] = size
        with self._cond:
            self._evict_until(0)
        metrics.RESIDENT.labels("disk").set(len(self._entries))

    def close(self) -> None:
        """Stop taking downloads (one under way finishes on its own thread)."""
        self._fetcher.shutdown(wait=False, cancel_futures=True)

    @property
    def max_bytes(self) -> int:
        return self._max_bytes

    def used_bytes(self) -> int:
        """Bytes of cached entries plus downloads in flight."""
        with self._cond:
            return sum(self._entries.values()) + self._reserved

    def _changed(self) -> None:
        """An entry came or went (``_cond`` held)."""
        metrics.RESIDENT.labels("disk").set(len(self._entries))
        self.on_change()

    def digests(self) -> list[str]:
        """The adapters on local disk now."""
        with self._cond:
            return list(self._entries)

    def path_for(self, digest: str) -> Path:
        return self._root / "adapters" / digest.removeprefix(DIGEST_PREFIX)

    def has(self, digest: str) -> bool:
        """The artifact is on local disk (complete, not yet re-verified)."""
        with self._cond:
            return digest in self._entries

    def in_use(self, digest: str) -> bool:
        """On disk, held by a job (or anything else), or being downloaded."""
        with self._cond:
            return (
                digest in self._entries
                or bool(self._holds.get(digest))
                or digest in self._downloads
            )

    @contextmanager
    def hold(self, digest: str) -> Iterator[None]:
        """Keep ``digest`` from eviction for the duration (it need not be present yet)."""
        with self._cond:
            self._holds[digest] += 1
        try:
            yield
        finally:
            with self._cond:
                self._holds[digest] -= 1
                released = self._holds[digest] == 0
                if released:
                    del self._holds[digest]
                    quarantined = self._quarantined.pop(digest, [])
                    # Only an entry nobody holds can be evicted to make room: wake waiters then.
                    self._cond.notify_all()
            if released:
                for path in quarantined:
                    shutil.rmtree(path, ignore_errors=True)

    def _touch(self, digest: str) -> bool:
        with self._cond:
            if digest not in self._entries:
                return False
            self._entries.move_to_end(digest)
            return True

    def ensure(
        self,
        digest: str,
        deadline_at: float | None = None,
        check: Callable[[], None] | None = None,
        count: bool = True,
    ) -> Fetched:
        """Make ``digest`` present on disk, downloading and verifying it if needed.

        Returns the verified digest of the written files when this call's download wrote
        them; ``loaded_digest`` is ``None`` when the files were already on disk (verify them
        before trusting them: see ``verify``). One download per digest however many jobs
        ask: they all wait for it, each no later than its ``deadline_at`` (unix time), then
        fail ``deadline_exceeded``; the download goes on (S3 retries, disk space) for the jobs
        still waiting and those to come. ``check`` (if given) is called while the job waits
        and raises to stop the wait (the job was stopped: engine failure, drain, cancel).
        ``count``: this request counts in ``digest``'s request rate (false when the
        look-ahead counted it while it waited).
        """
        if count:
            self.expect(digest)
        if self._touch(digest):
            return Fetched(self.path_for(digest), None, None, None)
        down_since: float | None = None
        outage: StoreDown | None = None
        asked = 0
        while True:
            with self._cond:
                download = self._downloads.get(digest)
                started = download is None
                if download is None:
                    download = self._fetcher.submit(self._download_once, digest, None)
                    self._downloads[digest] = download
            try:
                fetched = self._wait(download, deadline_at, check)
                break
            except NoRoom:
                continue  # a prefetch's download gave up for room: this job's own one now
            except StoreDown as down:
                # An outage of the store is waited out while the job has time: a job's
                # deadline (minutes) outlasts most, and failing it at once loses its run.
                asked += 1
                outage = down
                down_since = down_since or time.monotonic()
                exponential = min(STORE_RETRY_S * 2 ** (asked - 1), STORE_RETRY_MAX_S)
                delay = exponential * random.uniform(0.5, 1.0)
                if deadline_at is None or time.time() + delay >= deadline_at:
                    raise StoreDown(
                        f"{down.message} (asked {asked} times over "
                        f"{time.monotonic() - down_since:.1f} s; the job's deadline left no "
                        "time to ask again)"
                    ) from down
                log.warning("adapter %s: %s; asking again in %.1f s", digest, down, delay)
                _pause(delay, check)
            except JobFailure as failure:
                if outage is None or failure.code != ErrorCode.DEADLINE_EXCEEDED:
                    raise
                # The deadline came during an ask, after the store had been found down: the
                # same outage as when it comes during a pause between asks, and said the same.
                raise StoreDown(
                    f"{outage.message} (asked {asked} times over "
                    f"{time.monotonic() - (down_since or 0):.1f} s; the job's deadline came "
                    "during the next ask)"
                ) from failure
        if started:
            return fetched
        # Another job's download: the files are verified, but this job did not time them.
        return Fetched(fetched.path, fetched.loaded_digest, None, None)

    @staticmethod
    def _wait(
        download: concurrent.futures.Future[Fetched],
        deadline_at: float | None,
        check: Callable[[], None] | None,
    ) -> Fetched:
        while True:
            try:
                return download.result(timeout=wait_slice(deadline_at, check))
            except concurrent.futures.TimeoutError:
                if check is None or passed(deadline_at):
                    raise late("waited for its adapter's download") from None
            except NoRoom:
                raise
            except JobFailure as failure:
                raise failure.copy() from failure

    def prefetch(self, digest: str, protect: frozenset[str], evict: bool = True) -> Fetched | None:
        """Download and verify ``digest`` ahead of its jobs, exactly as ``ensure`` would, but
        making room only by evicting unheld entries outside ``protect`` (with ``evict``
        false: only in free room) and never waiting for room (``NoRoom``). ``None`` when it
        is on disk or being downloaded already.
        Raises what a job's download would (``AdapterIntegrityError`` for altered files:
        nothing of them is kept)."""
        with self._cond:
            if digest in self._entries or digest in self._downloads:
                return None
            download = self._fetcher.submit(
                self._download_once, digest, protect if evict else NO_EVICTION
            )
            self._downloads[digest] = download
        return download.result()

    def expect(self, digest: str, requests: float = 1.0) -> None:
        """Count ``requests`` more asking for ``digest`` in its decayed request rate."""
        now = time.monotonic()
        with self._cond:
            value, at = self._rate.get(digest, (0.0, now))
            self._rate[digest] = (value * math.exp((at - now) / self._decay_s) + requests, now)
            if len(self._rate) > 2 * len(self._entries) + 256 and now >= self._prune_at:
                self._prune_at = now + 60.0  # a scan a minute at most
                # Rates of digests not here (taken by other workers, failed) fade: drop those
                # that have decayed to nothing.
                for other, (count, since) in list(self._rate.items()):
                    faded = count * math.exp((since - now) / self._decay_s) < 0.01
                    if faded and other not in self._entries and other not in self._downloads:
                        del self._rate[other]

    def _costs(self) -> dict[str, float]:
        """What evicting each entry costs per byte it frees (lock held)."""
        now = time.monotonic()
        timed = [(ms, self._entries[d]) for d, ms in self._fetch_ms.items() if d in self._entries]
        per_byte = (
            sum(ms for ms, _ in timed) / max(sum(size for _, size in timed), 1)
            if timed
            else DEFAULT_FETCH_MS_PER_MB / 1e6
        )
        costs = {}
        for digest, size in self._entries.items():
            value, at = self._rate.get(digest, (0.0, now))
            rate = value * math.exp((at - now) / self._decay_s)
            # One timed fetch is one sample: on a busy host equal objects from the same store
            # vary tenfold and more. It is shrunk toward what the store's mean says for the
            # size (their geometric mean), so a fluke cannot outweigh a request rate.
            expected = per_byte * size
            timed_ms = self._fetch_ms.get(digest)
            fetch_ms = expected if timed_ms is None else math.sqrt(max(timed_ms, 0.0) * expected)
            costs[digest] = rate * fetch_ms / max(size, 1)
        return costs

    def _forget(self, digest: str) -> None:
        """An entry left the disk: drop what was kept about it (lock held)."""
        if digest not in self._downloads:
            self._rate.pop(digest, None)
        self._fetch_ms.pop(digest, None)
        self.on_evict(digest)

    def _download_once(self, digest: str, protect: frozenset[str] | None) -> Fetched:
        try:
            if self._touch(digest):  # a download that finished just before this one began
                return Fetched(self.path_for(digest), None, None, None)
            return self._download(digest, protect)
        finally:
            with self._cond:
                self._downloads.pop(digest, None)
                # A failed fetch keeps the adapter's request rate: those requests were made,
                # and the next fetch (the store back) should weigh them. Rates of adapters
                # not here fade and are pruned (``expect``).

    def verify(self, digest: str) -> tuple[str, float]:
        """Re-hash the files on disk; on mismatch quarantine them and fail closed.

        A quarantined entry is gone for new jobs at once (they download it again) but its
        files are deleted only when the last job holding the digest lets go.
        """
        start = time.perf_counter()
        path = self.path_for(digest)
        try:
            observed = manifest_of(path).digest()
        except OSError as exc:
            observed = f"nothing readable ({exc.strerror or exc})"
        if observed != digest:
            self._quarantine(digest, path)
            raise AdapterIntegrityError(
                f"Cached files of revision {digest} hash to {observed}; they were quarantined "
                "and will be fetched again."
            )
        return observed, _ms(start)

    def _quarantine(self, digest: str, path: Path) -> None:
        target = self._root / "quarantine" / f"{path.name}.{uuid.uuid4().hex[:8]}"
        with self._cond:
            if self._entries.pop(digest, None) is not None:
                self._forget(digest)
            self._changed()
            target.parent.mkdir(parents=True, exist_ok=True)
            try:
                os.rename(path, target)
            except FileNotFoundError:
                return  # another job quarantined it first
            metrics.EVICTIONS.labels("quarantine").inc()
            if self._holds.get(digest):
                self._quarantined.setdefault(digest, []).append(target)
                return
        shutil.rmtree(target, ignore_errors=True)

    def _evict_until(self, needed: int, protect: frozenset[str] = frozenset()) -> bool:
        """Evict unheld entries outside ``protect``, cheapest first (``policy``), until
        ``needed`` more bytes fit. Lock held."""
        used = sum(self._entries.values()) + self._reserved
        if used + needed <= self._max_bytes:
            return True
        order = list(self._entries)  # least recently used first
        if self._policy == "cost":
            costs = self._costs()
            order.sort(key=costs.__getitem__)  # stable: the least recently used breaks ties
        for digest in order:
            if used + needed <= self._max_bytes:
                break
            if self._holds.get(digest) or digest in protect:
                continue
            used -= self._entries.pop(digest)
            shutil.rmtree(self.path_for(digest), ignore_errors=True)
            metrics.EVICTIONS.labels("disk").inc()
            self._forget(digest)
            self._changed()
            log.info("disk cache evicted %s", digest)
        return used + needed <= self._max_bytes

    def _reserve(self, digest: str, size: int, protect: frozenset[str] | None = None) -> None:
        """Room for ``size`` bytes, waiting up to ``wait_s`` for held entries to be let go;
        for a prefetch (``protect`` given) room without evicting those, or ``NoRoom``."""
        if size > self._max_bytes:
            raise AdapterUnavailableError(
                f"Revision {digest} is {size} bytes, more than this worker's disk cache "
                f"({self._max_bytes} bytes)."
            )
        if protect is not None:
            with self._cond:
                if protect is NO_EVICTION:
                    fits = sum(self._entries.values()) + self._reserved + size <= self._max_bytes
                else:
                    fits = self._evict_until(size, protect | {digest})
                if not fits:
                    raise NoRoom(f"no room for prefetching {digest}")
                self._reserved += size
            return
        deadline = time.monotonic() + self._wait_s
        with self._cond:
            while not self._evict_until(size):
                remaining = deadline - time.monotonic()
                if remaining <= 0:
                    raise AdapterUnavailableError(
                        f"The disk cache is full of adapters in use; {digest} could not be "
                        f"fetched within {self._wait_s:.0f} s."
                    )
                self._cond.wait(remaining)
            self._reserved += size

    def _download(self, digest: str, protect: frozenset[str] | None) -> Fetched:
        start = time.perf_counter()
        manifest = self._fetch_manifest(digest)
        manifest_ms = _ms(start)
        self._reserve(digest, manifest.size_bytes, protect)
        tmp = self._root / "tmp" / f"{digest.removeprefix(DIGEST_PREFIX)}.{uuid.uuid4().hex}"
        try:
            tmp.mkdir()
            files_start = time.perf_counter()
            observed = tuple(self._fetch_file(entry, tmp) for entry in manifest.files)
            # The eviction weighs the store's time (manifest and files), not the wait for
            # disk room between; the job's metadata gets the whole time it waited.
            store_ms = round(manifest_ms + _ms(files_start), 3)
            fetch_ms = _ms(start)
            verify_start = time.perf_counter()
            loaded = Manifest(files=observed).digest()
            if loaded != digest:
                raise AdapterIntegrityError(
                    f"Downloaded files of revision {digest} hash to {loaded}; refused."
                )
            final = self.path_for(digest)
            self._place(tmp, final)
            with self._cond:
                self._entries[digest] = manifest.size_bytes
                self._fetch_ms[digest] = store_ms
                self._changed()
            return Fetched(final, loaded, fetch_ms, _ms(verify_start))
        except OSError as exc:
            # The disk, not the store or the job: full, read-only, a path that is not a
            # directory. The job fails visibly; nothing half-written stays.
            raise AdapterUnavailableError(
                f"This worker could not store revision {digest} in its disk cache: "
                f"{exc.strerror or exc} ({type(exc).__name__})."
            ) from exc
        finally:
            shutil.rmtree(tmp, ignore_errors=True)
            with self._cond:
                self._reserved -= manifest.size_bytes
                self._cond.notify_all()

    def _place(self, tmp: Path, final: Path) -> None:
        """Rename the verified download into place. A directory already there (left by a
        process that shared this cache, or an entry this one dropped but could not delete)
        is not one of ours: it is moved aside and deleted, never trusted."""
        try:
            os.rename(tmp, final)
        except OSError as exc:
            if not final.exists():
                raise
            stray = self._root / "quarantine" / f"{final.name}.{uuid.uuid4().hex[:8]}"
            stray.parent.mkdir(parents=True, exist_ok=True)
            log.warning("replacing stray cache directory %s (%s)", final, exc)
            os.rename(final, stray)
            os.rename(tmp, final)
            shutil.rmtree(stray, ignore_errors=True)

    def _get(self, key: str) -> Any:
        try:
            return self._s3.get_object(Bucket=self._bucket, Key=key)["Body"]
        except ClientError as exc:
            if _missing(exc):
                raise AdapterUnavailableError(f"Object {key} is missing from the store.") from exc
            status = int(exc.response.get("ResponseMetadata", {}).get("HTTPStatusCode") or 0)
            if status >= 500:
                raise StoreDown(f"The object store failed on {key}: {exc}") from exc
            raise AdapterUnavailableError(f"The object store refused {key}: {exc}") from exc
        except BotoCoreError as exc:
            raise StoreDown(f"The object store is unreachable: {exc}") from exc

    def _fetch_manifest(self, digest: str) -> Manifest:
        body = self._get(manifest_key(digest)).read()
        if DIGEST_PREFIX + hashlib.sha256(body).hexdigest() != digest:
            raise AdapterIntegrityError(f"The stored manifest of revision {digest} was altered.")
        try:
            manifest = Manifest.model_validate_json(body)
        except ValidationError as exc:
            raise AdapterIntegrityError(f"The manifest of {digest} is malformed.") from exc
        for entry in manifest.files:
            if "/" in entry.path or entry.path.startswith(".") or not entry.path:
                raise AdapterIntegrityError(
                    f"Manifest of {digest} names unsafe path {entry.path!r}."
                )
        return manifest

    def _fetch_file(self, entry: FileEntry, directory: Path) -> FileEntry:
        """Stream one blob to disk, hashing as it arrives; returns what was observed.

        botocore retries failed requests itself; a connection that breaks mid-body is retried
        here, from the start, up to ``stream_attempts`` times with jittered backoff.
        """
        for attempt in range(1, self._stream_attempts + 1):
            try:
                return self._stream_file(entry, directory)
            except _StreamBroken as broken:
                if attempt == self._stream_attempts:
                    raise StoreDown(
                        f"Download of {entry.path} failed {attempt} times: {broken}"
                    ) from broken
                log.warning("download of %s broke (%s); retrying", entry.path, broken)
                time.sleep(random.uniform(0.5, 1.0) * 0.2 * 2**attempt)
        raise AssertionError("unreachable")

    def _stream_file(self, entry: FileEntry, directory: Path) -> FileEntry:
        # No fsync: files renamed into the cache by an earlier process are re-hashed before
        # the engine may load them, so a torn write after a crash is caught there.
        body = self._get(blob_key(entry.sha256))
        writer = _HashingWriter(directory / entry.path)
        size = 0
        try:
            for chunk in body.iter_chunks(CHUNK_BYTES):
                size += len(chunk)
                if size > entry.size_bytes:
                    # Stop before writing past the space reserved for this artifact.
                    raise AdapterIntegrityError(
                        f"{entry.path} is larger than its manifest says "
                        f"({entry.size_bytes} bytes); refused."
                    )
                writer.write(chunk)
        except (BotoCoreError, HTTPError, ConnectionError) as exc:
            raise _StreamBroken(str(exc)) from exc
        finally:
            try:
                sha256 = writer.close()
            except OSError as exc:
                raise AdapterUnavailableError(f"Writing {entry.path} failed: {exc}") from exc
        observed = FileEntry(path=entry.path, sha256=sha256, size_bytes=size)
        if observed != entry:
            raise AdapterIntegrityError(
                f"{entry.path} does not match its manifest (sha256 {observed.sha256[:12]}..., "
                f"{size} bytes; expected {entry.sha256[:12]}..., {entry.size_bytes} bytes)."
            )
        return observed
