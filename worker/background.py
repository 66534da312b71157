"""Daemon threads that run until their owner closes them."""

from __future__ import annotations

import logging
import queue
import threading
import time
from collections.abc import Callable
from typing import Generic, TypeVar

from redis import exceptions as redis_errors
from redis.exceptions import RedisError

log = logging.getLogger(__name__)

T = TypeVar("T")

OUTAGE = (
    redis_errors.ConnectionError,  # BusyLoadingError too
    redis_errors.TimeoutError,
    OSError,
    redis_errors.ReadOnlyError,  # a replica behind the same address, or a failover under way
    redis_errors.TryAgainError,
    redis_errors.ClusterDownError,
    redis_errors.OutOfMemoryError,
)
"""Errors after which the same write may succeed later: Redis away, or unable to take writes
for now. Any other error reply or client-side error would fail the same write again."""
OUTAGE_LOG_S = 60.0
"""While an outage lasts, a writer says so this often (and once when it writes again)."""


class Background:
    """Runs ``loop(stopping)`` on a daemon thread; ``close`` sets ``stopping`` and joins."""

    def __init__(
        self, name: str, loop: Callable[[threading.Event], None], join_timeout_s: float
    ) -> None:
        self.stopping = threading.Event()
        self._join_timeout_s = join_timeout_s
        self._thread = threading.Thread(target=loop, args=(self.stopping,), name=name, daemon=True)

    def start(self) -> None:
        self._thread.start()

    def close(self) -> None:
        self.stopping.set()
        if self._thread.is_alive():
            self._thread.join(timeout=self._join_timeout_s)


class Periodic(Background):
    """Runs ``step()`` every ``interval_s`` until closed. A step that fails (Redis away, or
    anything else) is logged and tried again next time: it never ends the thread."""

    def __init__(self, name: str, interval_s: float) -> None:
        self._interval_s = interval_s
        super().__init__(name, self._every, join_timeout_s=interval_s + 10)

    def step(self) -> object:
        raise NotImplementedError

    def on_redis_error(self, exc: Exception) -> None:
        """A step could not reach Redis (subclasses may note the outage)."""

    def _every(self, stopping: threading.Event) -> None:
        while not stopping.wait(self._interval_s):
            try:
                self.step()
            except (RedisError, OSError) as exc:
                self.on_redis_error(exc)
                log.warning("%s failed (%s); retrying", self._thread.name, exc)
            except Exception:
                log.exception("%s failed", self._thread.name)


class _Wake:
    """Queued by ``close`` to wake a writer waiting for an item."""


_WAKE = _Wake()


class CoalescingWriter(Generic[T]):
    """Items put from any thread (never blocking), written in batches by a thread of its own.

    The first item of a batch waits ``coalesce_s`` for company; then everything queued goes to
    one ``write(items)``, in order. ``write`` must be safe to send again, whole, after a
    failure that applied part of it. A write that failed because Redis is away or cannot take
    writes for now (``OUTAGE``) is kept and retried every ``retry_s``, with what arrived
    meanwhile, until ``give_up_s`` has passed or the writer closes; then the batch is dropped
    with a warning naming ``dropped`` (what covers for it). Any other error (an error reply,
    a client-side error) drops the batch at once: retrying would fail alike. The thread starts
    with ``start`` or the first ``put``; ``close`` writes what is queued (one more try if Redis
    is away) within ``timeout_s``, and nothing is written after that.
    """

    def __init__(
        self,
        name: str,
        write: Callable[[list[T]], object],
        *,
        coalesce_s: float,
        retry_s: float,
        give_up_s: float,
        dropped: str,
    ) -> None:
        self.name = name
        self._write = write
        self._coalesce_s, self._retry_s, self._give_up_s = coalesce_s, retry_s, give_up_s
        self._dropped = dropped
        self._items: queue.SimpleQueue[T | _Wake] = queue.SimpleQueue()
        self._lock = threading.Lock()
        self._stopping = threading.Event()
        self._abandoned = False
        self._thread: threading.Thread | None = None

    def start(self) -> None:
        with self._lock:
            self._start()

    def _start(self) -> None:
        if self._thread is None and not self._stopping.is_set():
            self._thread = threading.Thread(target=self._run, name=self.name, daemon=True)
            self._thread.start()

    def put(self, item: T) -> bool:
        """Queue ``item``; False once closed (nothing will write it)."""
        with self._lock:
            if self._stopping.is_set():
                return False
            self._start()
            self._items.put(item)
        return True

    def close(self, timeout_s: float = 5.0) -> bool:
        """Whether everything queued was written or dropped in time; if not, the writer
        abandons the rest (a write already sent may still land)."""
        with self._lock:
            self._stopping.set()
            thread = self._thread
        if thread is None:
            return True
        self._items.put(_WAKE)
        thread.join(timeout=timeout_s)
        if thread.is_alive():
            self._abandoned = True
            log.warning(
                "%s: not done %g s after close; the rest is abandoned", self.name, timeout_s
            )
            return False
        return True

    def _run(self) -> None:
        try:
            self._loop()
        except BaseException:
            log.exception("%s: the writer stopped", self.name)
            raise
        finally:
            self._stopping.set()  # ``put`` refuses from now on: its callers fall back

    def _loop(self) -> None:
        pending: list[T] = []
        failing_since: float | None = None
        told_at = 0.0
        while not (self._stopping.is_set() and not pending and self._items.empty()):
            if not pending:
                first = self._items.get()
                if isinstance(first, _Wake):
                    continue
                pending.append(first)
                self._stopping.wait(self._coalesce_s)
            while True:
                try:
                    item = self._items.get_nowait()
                except queue.Empty:
                    break
                if not isinstance(item, _Wake):
                    pending.append(item)
            if self._abandoned:
                return
            try:
                self._write(pending)
            except OUTAGE as exc:
                now = time.monotonic()
                if failing_since is None:
                    failing_since = now
                if not self._stopping.is_set() and now - failing_since < self._give_up_s:
                    if now - told_at >= OUTAGE_LOG_S:
                        told_at = now
                        log.warning(
                            "%s: Redis cannot take writes (%s) for %.0f s; %d waiting, retrying",
                            self.name,
                            exc,
                            now - failing_since,
                            len(pending),
                        )
                    self._stopping.wait(self._retry_s)
                    continue
                log.warning(
                    "%s: %d not written (%s); dropped (%s)",
                    self.name,
                    len(pending),
                    exc,
                    self._dropped,
                )
            except Exception as exc:
                log.error(
                    "%s: %d could not be written (%r); dropped (%s)",
                    self.name,
                    len(pending),
                    exc,
                    self._dropped,
                )
            else:
                if failing_since is not None:
                    log.info(
                        "%s: writing again after %.1f s",
                        self.name,
                        time.monotonic() - failing_since,
                    )
            pending, failing_since, told_at = [], None, 0.0
