"""A daemon thread that runs until its owner closes it."""

from __future__ import annotations

import threading
from collections.abc import Callable


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
