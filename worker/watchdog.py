"""Watches the engine: a worker whose engine cannot run jobs must stop taking them.

Every ``check_s`` it reads vLLM's own verdict (``errored``: the engine-core process exited,
or the output handler died); every ``probe_s`` it makes a bounded round trip through the
engine loop and the engine core (``EngineHost.probe``), which catches what vLLM does not
report: a wedged event loop, an engine core that hangs in a step. Either marks the engine
failed (``EngineHost.fail``), and the runtime takes it from there.
"""

from __future__ import annotations

import logging
import threading
import time

from worker.background import Background
from worker.engine import EngineFailed, EngineHost

log = logging.getLogger(__name__)


class EngineWatch(Background):
    def __init__(
        self, host: EngineHost, check_s: float, probe_s: float, probe_timeout_s: float
    ) -> None:
        self._host = host
        self._check_s = check_s
        self._probe_s = probe_s
        self._probe_timeout_s = probe_timeout_s
        super().__init__("engine-watch", self._run, join_timeout_s=probe_timeout_s + 5)

    def _run(self, stopping: threading.Event) -> None:
        next_probe = time.monotonic() + self._probe_s
        while not stopping.wait(self._check_s) and self._host.failure is None:
            try:
                if self._host.engine.errored:
                    self._host.fail("the engine core process exited")
                elif time.monotonic() >= next_probe:
                    self._host.probe(self._probe_timeout_s, stopping)
                    next_probe = time.monotonic() + self._probe_s
            except EngineFailed:
                return
            except Exception:  # an unexpected probe error is not an engine failure by itself
                log.exception("engine probe failed")
