"""The GPU slot gate: never more distinct unpinned adapters in flight than free slots."""

from __future__ import annotations

import asyncio

import pytest

from worker.residency import SlotGate


def test_distinct_adapters_in_flight_never_exceed_capacity() -> None:
    gate = SlotGate(capacity=2)
    in_flight: dict[int, int] = {}
    most = 0

    async def job(adapter: int) -> None:
        nonlocal most
        async with gate.slot(adapter):
            in_flight[adapter] = in_flight.get(adapter, 0) + 1
            most = max(most, len(in_flight))
            await asyncio.sleep(0.01)
            in_flight[adapter] -= 1
            if not in_flight[adapter]:
                del in_flight[adapter]

    async def main() -> None:
        await asyncio.wait_for(asyncio.gather(*(job(i % 5) for i in range(40))), 30)

    asyncio.run(main())
    assert most == 2
    assert in_flight == {}


def test_jobs_for_an_adapter_already_in_flight_join_it() -> None:
    async def main() -> None:
        gate = SlotGate(capacity=1)
        other_done = asyncio.Event()

        async def other() -> None:
            async with gate.slot(8):
                other_done.set()

        async with gate.slot(7):
            async with gate.slot(7):  # the same adapter shares the slot at once
                pass
            waiter = asyncio.create_task(other())
            await asyncio.sleep(0.2)
            assert not other_done.is_set()  # another adapter waits for the slot
        await asyncio.wait_for(other_done.wait(), 5)
        await waiter

    asyncio.run(main())


def test_a_waiter_cancelled_leaves_the_others_waiting_and_takes_no_slot() -> None:
    """A job whose deadline passes (or that is cancelled) while it waits for a slot gives
    up without holding one, and the next waiter still gets in."""

    async def main() -> None:
        gate = SlotGate(capacity=1)
        entered: list[int] = []

        async def job(adapter: int) -> None:
            async with gate.slot(adapter):
                entered.append(adapter)

        async with gate.slot(1):
            doomed = asyncio.create_task(job(2))
            patient = asyncio.create_task(job(3))
            await asyncio.sleep(0.05)
            doomed.cancel()
            with pytest.raises(asyncio.CancelledError):
                await doomed
        await asyncio.wait_for(patient, 5)
        assert entered == [3]

    asyncio.run(main())


def test_raising_the_capacity_lets_waiters_in() -> None:
    async def main() -> None:
        gate = SlotGate(capacity=1)
        async with gate.slot(1):
            waiter = asyncio.create_task(_enter(gate, 2))
            await asyncio.sleep(0.05)
            assert not waiter.done()
            gate.set_capacity(2)
            await asyncio.wait_for(waiter, 5)

    asyncio.run(main())


async def _enter(gate: SlotGate, adapter: int) -> None:
    async with gate.slot(adapter):
        pass


def _popular_stream_then_rare(bypass_limit: int) -> tuple[list[str], int]:
    """A stream of jobs for adapter 1, each starting while the one before holds the slot,
    and one job for adapter 2 among them: the order they entered in, and how many had
    entered when the rare one asked for a slot."""

    async def main() -> tuple[list[str], int]:
        gate = SlotGate(capacity=1, bypass_limit=bypass_limit)
        order: list[str] = []
        started = 0
        entered_before = -1
        stop = asyncio.Event()

        async def popular(n: int) -> None:
            async with gate.slot(1):
                order.append(f"popular-{n}")
                await asyncio.sleep(0.01)

        async def stream() -> None:
            nonlocal started
            tasks = []
            while not stop.is_set() and started < 200:
                tasks.append(asyncio.create_task(popular(started)))
                started += 1
                await asyncio.sleep(0.002)
            await asyncio.gather(*tasks)

        async def rare() -> None:
            nonlocal entered_before
            entered_before = len(order)  # no await between this and asking for the slot
            async with gate.slot(2):
                order.append("rare")
                stop.set()

        feeder = asyncio.create_task(stream())
        await asyncio.sleep(0.02)  # the popular adapter holds the slot
        await asyncio.wait_for(rare(), 30)
        await feeder
        return order, entered_before

    return asyncio.run(main())


def test_a_waiter_is_not_starved_by_later_jobs_for_adapters_in_flight() -> None:
    """Strict first in, first out (no bypass): later jobs for the adapter holding the slot
    queue behind a waiting job instead of joining it."""
    order, arrived_after = _popular_stream_then_rare(bypass_limit=0)
    assert order.index("rare") == arrived_after
    assert len(order) > arrived_after + 1, "popular jobs that came later ran after it"


def test_jobs_that_join_ahead_of_a_waiter_are_bounded() -> None:
    """With a bypass limit, up to that many later jobs for the adapter in flight join it
    ahead of the waiting job (batching), and no more."""
    order, arrived_after = _popular_stream_then_rare(bypass_limit=5)
    assert order.index("rare") == arrived_after + 5
    assert len(order) > arrived_after + 6


def test_a_job_admitted_by_the_gate_and_cancelled_before_it_ran_frees_its_slot() -> None:
    async def main() -> None:
        gate = SlotGate(capacity=1)
        async with gate.slot(1):
            admitted = asyncio.create_task(_enter(gate, 2))
            await asyncio.sleep(0.01)
        # The slot was handed to adapter 2's waiter; it is cancelled before it resumes.
        admitted.cancel()
        with pytest.raises(asyncio.CancelledError):
            await admitted
        await asyncio.wait_for(_enter(gate, 3), 5)

    asyncio.run(main())


def _queued_behind_a_held_slot(
    bypass_limit: int, order: tuple[tuple[str, int], ...]
) -> tuple[list[str], list[str]]:
    """Jobs ``order`` ((name, adapter), each holding its slot until the end) queued while
    adapter 1 holds the only slot: who was let in once adapter 1 drained, and in all."""

    async def main() -> tuple[list[str], list[str]]:
        gate = SlotGate(capacity=1, bypass_limit=bypass_limit)
        let_in: list[str] = []
        release = asyncio.Event()

        async def job(name: str, adapter: int) -> None:
            async with gate.slot(adapter):
                let_in.append(name)
                await release.wait()

        async with gate.slot(1):
            queued = [asyncio.create_task(job(name, adapter)) for name, adapter in order]
            await asyncio.sleep(0.01)
            assert let_in == []  # all wait: adapter 1 holds the only slot
        await asyncio.sleep(0.01)
        drained = list(let_in)
        release.set()
        await asyncio.wait_for(asyncio.gather(*queued), 5)
        return drained, let_in

    return asyncio.run(main())


def test_queued_jobs_for_an_adapter_let_in_join_it_without_waiting_for_another_slot() -> None:
    """A burst queues jobs of many adapters behind one that waits for a slot. When a slot
    frees and the head is let in, the queued jobs of the adapters now in flight join them
    (within the bypass bound), as jobs arriving then would: otherwise every later job waits
    for one adapter at a time to drain, and the engine runs a handful of requests where it
    could batch hundreds (vs_vllm_serve at 256 at once: 0.3x of vLLM's server)."""
    drained, let_in = _queued_behind_a_held_slot(10, (("b1", 2), ("c1", 3), ("b2", 2)))
    assert drained == ["b1", "b2"], drained  # b2 joins adapter 2 in flight, past c1
    assert let_in == ["b1", "b2", "c1"]


def test_queued_joiners_stay_within_the_bypass_bound() -> None:
    """The joiners let in from the queue count against the bound like those arriving: past
    it, they keep their place behind the job waiting for a slot."""
    order = (("b1", 2), ("c1", 3), ("b2", 2), ("b3", 2), ("b4", 2))
    drained, let_in = _queued_behind_a_held_slot(2, order)
    assert drained == ["b1", "b2", "b3"], drained  # 2 joiners passed c1; b4 keeps its place
    assert let_in == ["b1", "b2", "b3", "c1", "b4"], let_in


def test_a_queued_joiner_let_in_and_cancelled_before_it_ran_frees_what_it_held() -> None:
    """A job the queue scan lets in may be cancelled before it resumes (its deadline, a
    DELETE): it releases its share of the adapter once, and the waiter behind gets in."""

    async def main() -> None:
        gate = SlotGate(capacity=1, bypass_limit=10)
        let_in: list[str] = []
        release_b1 = asyncio.Event()

        async def job(name: str, adapter: int, hold: asyncio.Event | None = None) -> None:
            async with gate.slot(adapter):
                let_in.append(name)
                if hold is not None:
                    await hold.wait()

        async with gate.slot(1):
            b1 = asyncio.create_task(job("b1", 2, release_b1))
            c1 = asyncio.create_task(job("c1", 3))
            b2 = asyncio.create_task(job("b2", 2))
            await asyncio.sleep(0.01)
            assert let_in == []
        # Adapter 1 drained: b1 let in, and b2 by the scan (c1 waits). b2 is cancelled in
        # the same step, before it resumed.
        b2.cancel()
        await asyncio.gather(b2, return_exceptions=True)
        await asyncio.sleep(0.01)
        assert let_in == ["b1"], let_in  # b2 never ran; c1 waits for adapter 2 to drain
        release_b1.set()
        await asyncio.wait_for(asyncio.gather(b1, c1), 5)
        assert let_in == ["b1", "c1"], let_in  # b2's share did not hold c1 back

    asyncio.run(main())
