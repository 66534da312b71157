"""A daemon thread that runs until its owner closes it."""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable

from redis.exceptions import RedisError

log = logging.getLogger(__name__)


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
