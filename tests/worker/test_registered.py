"""When a worker asks its engine which adapters it holds (pure logic: the engine host is a
stand-in that answers ``list_loras`` and counts the questions).

Every job used to ask (a round trip through the engine core); now the answer is kept until
something that could change it happened: a load, a pin, or a request naming an adapter
outside the answer (the engine loads that one from its path, evicting another, when it
schedules the request: no answer is kept until that request has ended).
"""

from __future__ import annotations

import asyncio
import threading
from collections.abc import Callable, Coroutine
from typing import Any

from vllm.lora.request import LoRARequest

from worker.residency import EngineAdapters


class Engine:
    def __init__(self) -> None:
        self.held = {1, 2}
        self.questions = 0
        self.answering: threading.Event | None = None  # set: hold the answer until released
        self.asked = threading.Event()

    async def list_loras(self) -> set[int]:
        self.questions += 1
        answer = set(self.held)
        self.asked.set()
        if self.answering is not None:
            await asyncio.get_running_loop().run_in_executor(None, self.answering.wait)
        return answer


class Host:
    def __init__(self) -> None:
        self.engine = Engine()

    def run(self, coro: Coroutine[Any, Any, Any], timeout_s: float | None = None) -> Any:
        return asyncio.run(coro)


def _adapters() -> tuple[EngineAdapters, Engine]:
    host = Host()
    return EngineAdapters(host, cache=None, max_loras=4), host.engine  # type: ignore[arg-type]


def _request(lora_id: int) -> LoRARequest:
    return LoRARequest(lora_name=f"a{lora_id}@0000", lora_int_id=lora_id, lora_path="/nowhere")


def _answer_while(
    adapters: EngineAdapters, engine: Engine, meanwhile: Callable[[], None]
) -> set[int]:
    """The answer to a question asked on another thread, ``meanwhile()`` having run while
    the engine's answer was on its way back."""
    engine.answering = threading.Event()
    answers: list[set[int]] = []
    asking = threading.Thread(target=lambda: answers.append(adapters.registered()))
    asking.start()
    assert engine.asked.wait(10)
    meanwhile()
    engine.answering.set()
    asking.join(10)
    engine.answering = None
    assert len(answers) == 1
    return answers[0]


def test_the_answer_is_kept_while_nothing_could_change_it() -> None:
    adapters, engine = _adapters()
    assert adapters.registered() == {1, 2}
    with adapters.entering(_request(2)):  # held: the engine loads nothing for it
        assert adapters.registered() == {1, 2}
    assert adapters.registered() == {1, 2}
    assert engine.questions == 1


def test_a_load_or_a_request_for_an_adapter_outside_the_answer_asks_again() -> None:
    adapters, engine = _adapters()
    adapters.registered()
    with adapters.entering(_request(3)):
        engine.held = {2, 3}  # the engine loads 3 for a request naming it, dropping 1
    assert adapters.registered() == {2, 3}
    adapters.changing()  # add_lora or a pin
    engine.held = {3, 4}
    assert adapters.registered() == {3, 4}
    assert engine.questions == 3


def test_an_answer_that_may_predate_a_change_is_used_once_and_not_kept() -> None:
    adapters, engine = _adapters()
    # A load starts while the question is on its way.
    assert _answer_while(adapters, engine, adapters.changing) == {1, 2}
    engine.held = {1, 2, 5}
    assert adapters.registered() == {1, 2, 5}  # asked again, not the earlier answer
    assert engine.questions == 2


def test_an_answer_without_the_adapter_of_a_request_in_the_engine_is_not_kept() -> None:
    """The engine loads a requested adapter when it schedules the request, which may be
    after a question answered meanwhile: that answer (without it, and with the adapter it
    will evict) is used once, not kept. One that holds it is kept, request or not."""
    adapters, engine = _adapters()
    adapters.registered()
    with adapters.entering(_request(3)):
        assert adapters.registered() == {1, 2}  # asked: 3 not loaded yet
        engine.held = {2, 3}  # scheduled now: 3 loaded, 1 evicted
        assert adapters.registered() == {2, 3}  # asked again, not the answer before
        assert adapters.registered() == {2, 3}  # holds 3: kept
    assert adapters.registered() == {2, 3}
    assert engine.questions == 3


def test_overlapping_requests_for_held_adapters_keep_the_answer() -> None:
    """Under load requests overlap without end: while they name adapters the engine holds,
    one question serves them all (a chain of requests must not keep it unanswered)."""
    adapters, engine = _adapters()
    adapters.changing()  # a load happened: nothing known
    outer = adapters.entering(_request(1))
    outer.__enter__()
    for lora_id in [2, 1, 2, 1, 2] * 20:
        with adapters.entering(_request(lora_id)):
            assert adapters.registered() == {1, 2}
    outer.__exit__(None, None, None)
    assert engine.questions == 1


def test_an_answer_asked_before_a_request_loaded_its_adapter_is_not_kept_after_it() -> None:
    """Nothing known; a question is on its way while a request for 3 enters, makes the engine
    load 3 (evicting 1) and ends before the answer is taken in: that answer ({1, 2}) is
    stale, and is used once, not kept."""
    adapters, engine = _adapters()

    def request_loads_3() -> None:
        with adapters.entering(_request(3)):
            engine.held = {2, 3}

    assert _answer_while(adapters, engine, request_loads_3) == {1, 2}
    assert adapters.registered() == {2, 3}  # asked again
    assert engine.questions == 2
