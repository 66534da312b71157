"""A serving process made ready for its first burst: its start-up heap set aside from garbage
collection, its job threads started before the jobs arrive.

CPython's cyclic collector traverses every tracked object of the oldest generation in a full
collection, with every thread of the process stopped. A worker holds vLLM, torch and
transformers (about 740,000 tracked objects once its engine is up), a gateway FastAPI, pydantic
and its clients (about 110,000); the allocations of a burst set a full collection off every few
seconds, and it stopped the worker for 360-530 ms and the gateway for about 100 ms, once a
burst of 256 requests (README, "Measured"): for that long the worker's consumer received no job
and its engine loop fed the engine none. ``gc.freeze()`` moves every object alive into a
permanent generation that no collection traverses; what is made afterwards is collected as
before. vLLM's own server and its engine core do the same after start-up (``freeze_gc_heap``).
The price: a frozen object that later becomes part of a reference cycle nobody holds is not
freed until the heap is thawed, so only what lives as long as the process should be alive when
it is frozen.

A ``ThreadPoolExecutor`` starts its threads one per submission, as the first jobs arrive, and
``Thread.start`` waits for the new thread to run: in the worker's one consumer thread, while the
engine loop and the jobs already started hold the GIL, each cost about 2 ms, so the first
burst after start-up (a worker just scaled up for a deep queue) was received at a third of
the rate of the next ones. ``start_threads`` starts them all up front.
"""

from __future__ import annotations

import gc
import threading
from concurrent.futures import ThreadPoolExecutor


def freeze_heap() -> int:
    """Collect, then freeze every object alive now; how many objects are frozen. A second
    call freezes what was made since (``thaw_heap`` undoes both)."""
    gc.collect()
    gc.freeze()
    return gc.get_freeze_count()


def thaw_heap() -> None:
    """Give the frozen objects back to the collector, at the end of what froze them: what
    became garbage meanwhile is then freed (at interpreter exit too, where extension modules
    such as triton's report objects still frozen as leaks)."""
    gc.unfreeze()


def start_threads(executor: ThreadPoolExecutor, count: int, timeout_s: float = 30.0) -> None:
    """Make ``executor`` start ``count`` threads now (up to its ``max_workers``), each left idle
    for the submissions to come. Each of ``count`` placeholder tasks holds its thread until
    all have started, so none is reused for the next; raises ``TimeoutError`` if the threads
    did not all start within ``timeout_s`` (the placeholders are released either way)."""
    gate = threading.Barrier(count + 1)

    def hold() -> None:
        # Broken by the caller's timeout: the thread is idle all the same.
        try:
            gate.wait()
        except threading.BrokenBarrierError:
            return

    futures = [executor.submit(hold) for _ in range(count)]
    try:
        gate.wait(timeout_s)
    except threading.BrokenBarrierError:
        raise TimeoutError(f"{count} threads did not start within {timeout_s} s") from None
    finally:
        gate.abort()
        for future in futures:
            future.result()
