"""The watchdog's probe on a real ``EngineHost`` loop with a stand-in engine core (pure logic:
a real core cannot be made to answer slowly while it streams, on demand).

An engine that does not answer a probe in time is wedged only if it gave no job an output
meanwhile: CI once saw a loaded engine (several engines bound to one core) fail its probe while
its jobs were generating, and the worker's exit cost those jobs an attempt each.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Iterator

import pytest

from worker.engine import EngineFailed, EngineHost, EngineOptions

PROBE_S = 0.3


class SlowCore:
    """Answers ``is_sleeping`` never (a wedged or an overloaded core); reports itself alive."""

    errored = False

    async def check_health(self) -> None:
        return None

    async def is_sleeping(self) -> bool:
        await asyncio.sleep(3600)
        return False

    def shutdown(self) -> None:
        return None


@pytest.fixture
def host() -> Iterator[EngineHost]:
    options = EngineOptions(
        model="stand-in",
        dtype="float32",
        max_model_len=None,
        max_loras=1,
        max_cpu_loras=1,
        max_lora_rank=8,
        max_num_seqs=None,
        max_num_batched_tokens=None,
        gpu_memory_utilization=0.3,
        enforce_eager=True,
    )
    engine_host = EngineHost(options)
    engine_host._thread.start()
    engine_host._engine = SlowCore()  # type: ignore[assignment]
    yield engine_host
    engine_host.shutdown()


def test_a_probe_unanswered_while_no_job_gets_output_fails_the_engine(host: EngineHost) -> None:
    with pytest.raises(EngineFailed, match="did not answer a health probe"):
        host.probe(PROBE_S)
    assert host.failure is not None


def test_a_probe_unanswered_while_jobs_get_outputs_leaves_the_engine_serving(
    host: EngineHost,
) -> None:
    stop = time.monotonic() + 3 * PROBE_S

    async def stream() -> None:  # a job's outputs, as the runner records them on the loop
        while time.monotonic() < stop:
            host.progressed()
            await asyncio.sleep(PROBE_S / 10)

    outputs = host.submit(stream())
    host.probe(PROBE_S)  # slow, but tokens flow: busy, not wedged
    assert host.failure is None
    outputs.result(timeout=10)
    # The outputs stop (the core hung mid-step): the next unanswered probe fails it.
    with pytest.raises(EngineFailed):
        host.probe(PROBE_S)
    assert host.failure is not None
