"""A task on the gateway's event loop that runs for the app's lifespan."""

from __future__ import annotations

import asyncio
import contextlib


class LoopTask:
    """``run()`` as a task of the running loop from ``start`` until ``stop``."""

    def __init__(self, name: str) -> None:
        self._name = name
        self._task: asyncio.Task[None] | None = None

    async def run(self) -> None:
        raise NotImplementedError

    def start(self) -> None:
        self._task = asyncio.create_task(self.run(), name=self._name)

    async def stop(self) -> None:
        task = self._task
        if task is None:
            return
        # A cancellation that lands while redis-py's asyncio client connects can be lost
        # (redis/redis-py#2028; seen here in a third of tries): the task would run on, and
        # the app's shutdown wait for ever. Cancel again until it ends.
        while not task.done():
            task.cancel()
            await asyncio.wait({task}, timeout=0.1)
        with contextlib.suppress(asyncio.CancelledError):
            await task
