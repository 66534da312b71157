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
        if self._task is not None:
            self._task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._task
