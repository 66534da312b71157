"""The GPU slot gate: never more distinct unpinned adapters in flight than free slots.

Most cases drain at once (``drain_after_s=0``): the oldest adapter stops taking jobs as soon
as one waits; the delay before it does is tested with a clock of the test's own."""

from __future__ import annotations

import asyncio

import pytest

from worker.residency import SlotGate


def test_distinct_adapters_in_flight_never_exceed_capacity() -> None:
    gate = SlotGate(capacity=2, drain_after_s=0)
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
        gate = SlotGate(capacity=1, drain_after_s=0)
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
        gate = SlotGate(capacity=1, drain_after_s=0)
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
        gate = SlotGate(capacity=1, drain_after_s=0)
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


def _popular_stream_then_rare() -> tuple[list[str], int]:
    """A stream of jobs for adapter 1, each starting while the one before holds the only
    slot, and one job for adapter 2 among them: the order they entered in, and how many had
    entered when the rare one asked for a slot."""

    async def main() -> tuple[list[str], int]:
        gate = SlotGate(capacity=1, drain_after_s=0)
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
    """The adapter holding the slot drains while another waits: later jobs for it queue
    behind the waiting job instead of joining it, and the waiter enters as soon as the jobs
    in flight when it came have ended."""
    order, arrived_after = _popular_stream_then_rare()
    assert order.index("rare") == arrived_after, order
    assert len(order) > arrived_after + 1, "popular jobs that came later ran after it"


class _Jobs:
    """Jobs that each hold their slot until the test ends them; ``entered``: in order."""

    def __init__(self, gate: SlotGate) -> None:
        self._gate = gate
        self.entered: list[str] = []
        self._ends: dict[str, asyncio.Event] = {}
        self._tasks: list[asyncio.Task[None]] = []

    async def start(self, name: str, adapter: int) -> None:
        """Ask for a slot, and give the loop the time to let it in if it may."""
        self._ends[name] = asyncio.Event()
        self._tasks.append(asyncio.create_task(self._job(name, adapter)))
        await asyncio.sleep(0.01)

    async def _job(self, name: str, adapter: int) -> None:
        async with self._gate.slot(adapter):
            self.entered.append(name)
            await self._ends[name].wait()

    async def end(self, *names: str) -> None:
        for name in names:
            self._ends[name].set()
        await asyncio.sleep(0.01)

    async def finish(self) -> None:
        for event in self._ends.values():
            event.set()
        await asyncio.wait_for(asyncio.gather(*self._tasks), 5)


def test_only_the_adapter_holding_its_slot_longest_drains_for_a_waiter() -> None:
    """Two slots held by adapters 1 (first) and 2; a job for adapter 3 waits. A later job for
    adapter 2 joins it at once (the engine batches it: no slot is spent), a later one for
    adapter 1 queues: adapter 1's slot is the one the waiter gets when its jobs end."""

    async def main() -> None:
        jobs = _Jobs(SlotGate(capacity=2, drain_after_s=0))
        for name, adapter in (("a1", 1), ("b1", 2), ("c1", 3), ("a2", 1), ("b2", 2)):
            await jobs.start(name, adapter)
        assert jobs.entered == ["a1", "b1", "b2"], jobs.entered  # b2 joined; c1 and a2 wait
        await jobs.end("a1")  # adapter 1 drained: its slot goes to c1, not to a2
        assert jobs.entered == ["a1", "b1", "b2", "c1"], jobs.entered
        await jobs.end("b1", "b2")  # adapter 2 drained in turn: a2 gets its slot
        assert jobs.entered == ["a1", "b1", "b2", "c1", "a2"], jobs.entered
        await jobs.finish()

    asyncio.run(main())


class _Clock:
    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


def test_an_adapter_drains_only_once_a_job_has_waited_the_drain_delay() -> None:
    """Until the job at the head has waited ``drain_after_s``, jobs of the adapters in flight
    join them, the oldest's too (vLLM's scheduler: the batch stays full); from then on the
    oldest takes no more, and the waiter gets its slot when its requests end."""

    async def main() -> None:
        clock = _Clock()
        jobs = _Jobs(SlotGate(capacity=1, drain_after_s=0.5, clock=clock))
        await jobs.start("a1", 1)
        await jobs.start("b1", 2)  # waits: adapter 1 holds the slot
        clock.now += 0.4
        await jobs.start("a2", 1)  # b1 waited 0.4 s: a2 joins
        assert jobs.entered == ["a1", "a2"], jobs.entered
        clock.now += 0.2
        await jobs.start("a3", 1)  # b1 waited 0.6 s: adapter 1 drains
        assert jobs.entered == ["a1", "a2"], jobs.entered
        await jobs.end("a1", "a2")
        assert jobs.entered == ["a1", "a2", "b1"], jobs.entered  # b1 took the slot, a3 behind
        await jobs.finish()
        assert jobs.entered == ["a1", "a2", "b1", "a3"], jobs.entered

    asyncio.run(main())


def test_queued_jobs_join_their_adapter_once_nobody_has_waited_long() -> None:
    """Jobs that queued behind a waiter while their adapter drained join it when that waiter
    is let in and the next one at the head has not waited the drain delay yet."""

    async def main() -> None:
        clock = _Clock()
        jobs = _Jobs(SlotGate(capacity=2, drain_after_s=0.5, clock=clock))
        await jobs.start("a1", 1)
        await jobs.start("b1", 2)
        await jobs.start("c1", 3)  # waits for a slot
        clock.now += 1.0  # c1 waited long: adapter 1, the oldest, drains
        await jobs.start("d1", 4)  # waits behind c1, from now
        await jobs.start("a2", 1)  # queues: adapter 1 drains for c1
        assert jobs.entered == ["a1", "b1"], jobs.entered
        await jobs.end("b1")  # adapter 2's slot frees first: c1 takes it
        # d1, at the head now, has not waited long: nobody drains, and a2 joined adapter 1.
        assert jobs.entered == ["a1", "b1", "c1", "a2"], jobs.entered
        await jobs.finish()

    asyncio.run(main())


def test_a_job_admitted_by_the_gate_and_cancelled_before_it_ran_frees_its_slot() -> None:
    async def main() -> None:
        gate = SlotGate(capacity=1, drain_after_s=0)
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
    order: tuple[tuple[str, int], ...], later: tuple[tuple[str, int], ...] = ()
) -> tuple[list[str], list[str]]:
    """Jobs ``order`` ((name, adapter), each holding its slot until the end) queued while
    adapter 1 holds the only slot, and ``later`` ones asking once adapter 1 drained: who was
    let in once it drained (before ``later`` came), and in all."""

    async def main() -> tuple[list[str], list[str]]:
        gate = SlotGate(capacity=1, drain_after_s=0)
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
        for name, adapter in later:
            queued.append(asyncio.create_task(job(name, adapter)))
        await asyncio.sleep(0.01)
        release.set()
        await asyncio.wait_for(asyncio.gather(*queued), 5)
        return drained, let_in

    return asyncio.run(main())


def test_queued_jobs_for_an_adapter_let_in_join_it_without_waiting_for_another_slot() -> None:
    """A burst queues jobs of many adapters behind one that waits for a slot. When a slot
    frees and the head is let in, the queued jobs of its adapter join it, although with one
    slot it is the adapter that drains next: otherwise each adapter would run one job per
    slot it takes, and the engine a handful of requests where it could batch hundreds
    (vs_vllm_serve at 256 at once: 0.3x of vLLM's server with such a gate)."""
    drained, let_in = _queued_behind_a_held_slot((("b1", 2), ("c1", 3), ("b2", 2), ("c2", 3)))
    assert drained == ["b1", "b2"], drained  # b2 joins adapter 2 let in, past c1
    assert let_in == ["b1", "b2", "c1", "c2"], let_in  # c2 came with c1


def test_a_job_for_the_draining_adapter_that_came_after_its_backlog_waits() -> None:
    """An adapter let in takes its backlog, not what comes after: with a job of another
    adapter waiting, its later jobs queue behind that job (no popular adapter keeps the slot
    for good)."""
    order = (("b1", 2), ("c1", 3), ("b2", 2))
    drained, let_in = _queued_behind_a_held_slot(order, later=(("b3", 2),))
    assert drained == ["b1", "b2"], drained
    assert let_in == ["b1", "b2", "c1", "b3"], let_in


def test_a_queued_joiner_let_in_and_cancelled_before_it_ran_frees_what_it_held() -> None:
    """A job the queue scan lets in may be cancelled before it resumes (its deadline, a
    DELETE): it releases its share of the adapter once, and the waiter behind gets in."""

    async def main() -> None:
        gate = SlotGate(capacity=1, drain_after_s=0)
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
        # Adapter 1 drained: b1 let in, and b2 with it, its backlog (c1 waits). b2 is
        # cancelled in the same step, before it resumed.
        b2.cancel()
        await asyncio.gather(b2, return_exceptions=True)
        await asyncio.sleep(0.01)
        assert let_in == ["b1"], let_in  # b2 never ran; c1 waits for adapter 2 to drain
        release_b1.set()
        await asyncio.wait_for(asyncio.gather(b1, c1), 5)
        assert let_in == ["b1", "c1"], let_in  # b2's share did not hold c1 back

    asyncio.run(main())
