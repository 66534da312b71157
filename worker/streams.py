"""Text deltas of streaming jobs, appended to a Redis stream per job as they are produced.

Entries carry the execution that wrote them (its lease value, ``worker id|attempt``, unique
even when an attempt handed back uncounted is run again under the same number): after a
crash and redelivery the new execution streams from the start again, and the reader (the
gateway) skips what it already sent. Entries also carry where their text starts in the
execution's text (``off``, UTF-8 bytes): a call that ran but whose reply was lost is sent again
(with what was published since), and the script appends only what the stream lacks, so no
text is ever written twice. The stream expires ``STREAM_TTL_S`` after its last entry (or
``job_ttl_s``, if shorter: a stream is never kept longer than its job's record); the job record
keeps the full result regardless.

The engine loop hands each delta over without waiting (``publish``); one writer thread
appends whatever accumulated, per job coalesced into one entry, for every job in one script
call (``contracts.job_records.APPEND_DELTAS``), which refuses text from an attempt that no
longer holds its job's lease (and takes a lease that expired while Redis was away back for
the attempt the record still names, as the lease keeper would). A Redis outage delays text,
never drops or reorders it: the writer retries. ``flush`` waits until a job's text is all
written, so the stream is complete before the outcome is stored (readers rely on that).
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable

from redis import Redis
from redis.exceptions import RedisError

from contracts.job_records import APPEND_DELTAS, append_call, lease_value
from contracts.keys import STREAM_TTL_S
from worker.background import Background

log = logging.getLogger(__name__)

RETRY_S = 0.2

_Attempt = tuple[str, int]  # (job id, attempt number)


class StreamFenced(Exception):
    """The attempt lost its job's lease: its text was refused (another attempt owns it)."""


class DeltaPublisher:
    def __init__(
        self,
        redis: Redis,
        worker_id: str,
        lease_ttl_s: float,
        on_outage: Callable[[], None] = lambda: None,
        stream_ttl_s: int = STREAM_TTL_S,
    ) -> None:
        self._redis = redis
        self._worker_id = worker_id
        self._lease_ttl_s = lease_ttl_s
        self._stream_ttl_s = stream_ttl_s
        self._on_outage = on_outage
        self._append = redis.register_script(APPEND_DELTAS)
        # One lock, two conditions: the writer waits for text, flushes for a write to end.
        # A delta wakes no flush, and the writer only if nothing was pending (it looks at
        # what is pending before it waits).
        self._lock = threading.Lock()
        self._text = threading.Condition(self._lock)
        self._wrote = threading.Condition(self._lock)
        self._pending: dict[_Attempt, list[str]] = {}
        self._writing: set[_Attempt] = set()
        self._fenced: set[_Attempt] = set()
        # UTF-8 bytes of each open attempt's text known to be in its stream (where its next
        # text starts): a batch sent again after a lost reply is appended from where it ended.
        # Only open attempts publish (``open``); ``finish`` and ``discard`` end them.
        self._written: dict[_Attempt, int] = {}
        self._closing: set[_Attempt] = set()  # finished with text still to write
        self._writer = Background("stream-writer", self._run, join_timeout_s=5)

    def start(self) -> None:
        self._writer.start()

    def close(self) -> None:
        with self._lock:
            self._writer.stopping.set()
            self._text.notify_all()
        self._writer.close()

    def open(self, job_id: str, attempt: int) -> None:
        """``attempt`` will publish its text from the start (before it generates)."""
        with self._lock:
            self._written[(job_id, attempt)] = 0
            self._closing.discard((job_id, attempt))

    def finish(self, job_id: str, attempt: int) -> None:
        """``attempt`` publishes no more; what it published is still written."""
        key = (job_id, attempt)
        with self._lock:
            if key in self._pending or key in self._writing:
                self._closing.add(key)
            else:
                self._written.pop(key, None)

    def publish(self, job_id: str, attempt: int, text: str) -> None:
        """Queue one delta of ``attempt`` (called on the engine loop: never blocks on Redis).
        Text of an attempt that is not open (discarded: the job was stopped, and its task on
        the engine loop had one more delta on its way) is dropped."""
        key = (job_id, attempt)
        with self._lock:
            if key not in self._written or key in self._closing:
                return
            if not self._pending:  # else the writer finds it pending before it waits
                self._text.notify()
            self._pending.setdefault(key, []).append(text)

    def flush(self, job_id: str, attempt: int, timeout_s: float) -> None:
        """Wait until every delta published for ``attempt`` is in its stream.

        Raises ``StreamFenced`` if the attempt lost its lease, ``TimeoutError`` if Redis did
        not take the text within ``timeout_s``.
        """
        key = (job_id, attempt)
        deadline = time.monotonic() + timeout_s
        with self._lock:
            try:
                while key in self._pending or key in self._writing:
                    remaining = deadline - time.monotonic()
                    if remaining <= 0:
                        raise TimeoutError(f"the stream of job {job_id} could not be written")
                    self._wrote.wait(remaining)
                if key in self._fenced:
                    raise StreamFenced(job_id)
            finally:
                self._fenced.discard(key)

    def discard(self, job_id: str, attempt: int) -> None:
        """Forget ``attempt``, which publishes no more: drop what it published and has not
        been written (the job was stopped), and where its text ends."""
        with self._lock:
            self._pending.pop((job_id, attempt), None)
            self._fenced.discard((job_id, attempt))
            self._written.pop((job_id, attempt), None)
            self._closing.discard((job_id, attempt))

    def _run(self, stopping: threading.Event) -> None:
        while True:
            with self._lock:
                while not self._pending and not stopping.is_set():
                    self._text.wait()
                if not self._pending:
                    return
                batch, self._pending = self._pending, {}
                self._writing = set(batch)
            try:
                refused = self._write(batch)
            except (RedisError, OSError) as exc:
                self._on_outage()
                log.warning("stream deltas not written (%s); retrying", exc)
                with self._lock:
                    # Older text first: what was published meanwhile follows it. An attempt
                    # discarded meanwhile (its job stopped) is forgotten, not written again.
                    batch = {key: texts for key, texts in batch.items() if key in self._written}
                    for key, texts in self._pending.items():
                        batch.setdefault(key, []).extend(texts)
                    self._pending, self._writing = batch, set()
                if stopping.wait(RETRY_S):
                    return
                continue
            except Exception:
                # Not an outage: writing this batch again would fail again. Its attempts are
                # refused (each stops as if its lease were lost) and the writer lives on: a dead
                # writer would stall every streamed job of this worker at its flush.
                log.exception("stream deltas could not be written; their jobs are stopped")
                refused = set(batch)
            with self._lock:
                # Kept for the attempt's flush; one discarded meanwhile has none to come.
                self._fenced |= {key for key in refused if key in self._written}
                self._writing = set()
                for key in [key for key in self._closing if key not in self._pending]:
                    self._closing.discard(key)  # finished, and now all written (or refused)
                    self._written.pop(key, None)
                    self._fenced.discard(key)  # nobody flushes a finished attempt again
                self._wrote.notify_all()

    def _write(self, batch: dict[_Attempt, list[str]]) -> set[_Attempt]:
        order = list(batch)
        with self._lock:
            offsets = [self._written.get(key, 0) for key in order]
        texts = ["".join(batch[key]) for key in order]
        deltas = [
            (job_id, lease_value(self._worker_id, attempt), offset, text)
            for (job_id, attempt), offset, text in zip(order, offsets, texts, strict=True)
        ]
        keys, args = append_call(deltas, self._stream_ttl_s, self._lease_ttl_s)
        refused = {
            order[int(position) - 1] for position in self._append(keys=keys, args=args) or ()
        }
        with self._lock:
            for key, offset, text in zip(order, offsets, texts, strict=True):
                if key not in refused and key in self._written:  # not flushed nor discarded
                    self._written[key] = offset + len(text.encode())
        return refused
