"""The GPU slot gate: never more distinct unpinned adapters in flight than free slots."""

from __future__ import annotations

import threading
import time

from worker.residency import SlotGate


def test_distinct_adapters_in_flight_never_exceed_capacity() -> None:
    gate = SlotGate(capacity=2)
    lock = threading.Lock()
    in_flight: dict[int, int] = {}
    most = 0

    def job(adapter: int) -> None:
        nonlocal most
        with gate.slot(adapter):
            with lock:
                in_flight[adapter] = in_flight.get(adapter, 0) + 1
                most = max(most, len(in_flight))
            time.sleep(0.01)
            with lock:
                in_flight[adapter] -= 1
                if not in_flight[adapter]:
                    del in_flight[adapter]

    threads = [threading.Thread(target=job, args=(i % 5,)) for i in range(40)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(timeout=30)
    assert most == 2
    assert in_flight == {}


def test_jobs_for_an_adapter_already_in_flight_join_it() -> None:
    gate = SlotGate(capacity=1)
    other_done = threading.Event()

    def other() -> None:
        with gate.slot(8):
            other_done.set()

    with gate.slot(7):
        with gate.slot(7):  # the same adapter shares the slot at once
            pass
        waiter = threading.Thread(target=other)
        waiter.start()
        assert not other_done.wait(0.2)  # another adapter waits for the slot
    assert other_done.wait(5)
    waiter.join()
