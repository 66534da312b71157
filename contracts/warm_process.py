"""A serving process made ready for its first burst: its start-up heap set aside from garbage
collection, its job threads started before the jobs arrive.

CPython's cyclic collector traverses every tracked object of the oldest generation in a full
collection, and no thread that needs the GIL runs meanwhile. A worker holds vLLM, torch and
transformers (about 740,000 tracked objects once its engine is up), a gateway FastAPI, pydantic
and its clients; the allocations of a burst set a full collection off every few seconds, and it
stopped the worker for 446 and 510 ms in the first burst of 256 requests after start-up, the
gateway for 89-96 ms in later ones (README, "A burst's intake: full collections and thread
starts"): for that long the worker's consumer received no job and its engine loop fed the
engine none. ``gc.freeze()`` moves every object alive into a permanent generation that no
collection traverses; what is made afterwards is collected as before. vLLM's own server and its
engine core do the same after start-up (``freeze_gc_heap``). The price: a frozen object that
later becomes part of a reference cycle nobody holds is not freed until the heap is thawed, so
only what lives as long as the process should be alive when it is frozen.

A ``ThreadPoolExecutor`` starts its threads one per submission, as the first jobs arrive, and
``Thread.start`` waits for the new thread to run: in the worker's one consumer thread, while
the engine loop and the jobs already started hold the GIL. With the heaps frozen but no thread
started ahead, the second half of the first burst was received in 424 ms, of later bursts in
123-198 ms. ``start_threads`` starts them all up front.
"""

from __future__ import annotations

import gc
import threading
from concurrent.futures import Future, ThreadPoolExecutor

_holders = 0
_holders_lock = threading.Lock()


def freeze_heap() -> int:
    """Collect, then freeze every object alive now; how many objects are frozen. Several
    holders may freeze (apps sharing a process): each ``thaw_heap`` ends one hold, and the
    heap is thawed when the last one ends."""
    global _holders
    with _holders_lock:
        _holders += 1
        gc.collect()
        gc.freeze()
        return gc.get_freeze_count()


def thaw_heap() -> None:
    """End one hold of ``freeze_heap``; the last gives every frozen object back to the
    collector: what became garbage meanwhile is then freed (at interpreter exit too, where
    extension modules such as triton's report objects still frozen as leaks)."""
    global _holders
    with _holders_lock:
        _holders = max(0, _holders - 1)
        if _holders == 0:
            gc.unfreeze()


def start_threads(executor: ThreadPoolExecutor, count: int, timeout_s: float = 30.0) -> None:
    """Make ``executor`` start ``count`` threads now, each left idle for the submissions to
    come. Each of ``count`` placeholder tasks holds its thread until all have started, so none
    is reused for the next; ``count`` must not exceed the executor's ``max_workers`` (more
    can never all start). Raises ``TimeoutError`` if they did not all start within
    ``timeout_s``, and what ``submit`` raises; either way no placeholder is left holding a
    thread."""
    gate = threading.Barrier(count + 1)

    def hold() -> None:
        # Broken by the caller (its timeout, a failed submission): idle all the same.
        try:
            gate.wait()
        except threading.BrokenBarrierError:
            return

    futures: list[Future[None]] = []
    try:
        for _ in range(count):
            futures.append(executor.submit(hold))
        gate.wait(timeout_s)
    except threading.BrokenBarrierError:
        raise TimeoutError(f"{count} threads did not start within {timeout_s} s") from None
    finally:
        gate.abort()
        for future in futures:
            future.result()
