"""The SSE body of a streamed completion, written by ``gateway.routes.openai._events``."""

from __future__ import annotations

import asyncio
import json
from collections.abc import AsyncGenerator, AsyncIterator
from types import SimpleNamespace
from typing import Any, cast

import pytest

from contracts.jobs import JobPublic, JobResult, JobStatus, Usage
from gateway.openai_schemas import CompletionCreate
from gateway.routes import openai
from tests.helpers import new_job


class _Follower:
    """A stream hub whose follower yields ``items`` (text deltas, then the job)."""

    def __init__(self, items: list[str | JobPublic]) -> None:
        self._items = items

    async def follow(
        self, job: JobPublic, timeout_s: float, opened: bool = False
    ) -> AsyncIterator[str | JobPublic]:
        for item in self._items:
            yield item


def _stream(
    job: JobPublic,
    items: list[str | JobPublic],
    include_usage: bool = False,
    kind: Any = openai._TEXT,
    model: str = "a",
) -> AsyncGenerator[bytes, None]:
    """The writes of ``job``'s streamed completion whose follower yields ``items``."""
    body = CompletionCreate.model_validate(
        {"model": "a", "prompt": "hi", "stream": True}
        | ({"stream_options": {"include_usage": True}} if include_usage else {})
    )
    body.model = model  # any name the head may carry, unchecked
    call: Any = SimpleNamespace(streams=_Follower(items))
    events = openai._events(call, job, body, kind, 0, 60.0, True)
    return cast(AsyncGenerator[bytes, None], events)  # an async generator, typed as an iterator


def _writes(items: list[str | JobPublic], include_usage: bool) -> list[bytes]:
    async def collect() -> list[bytes]:
        stream = _stream(new_job(status=JobStatus.RUNNING), items, include_usage)
        return [write async for write in stream]

    return asyncio.run(collect())


def _events_of(write: bytes) -> list[str]:
    return [event for event in write.decode().split("\n\n") if event]


def _data(event: str) -> Any:
    return json.loads(event.removeprefix("data: "))


def _finished(job: JobPublic) -> JobPublic:
    result = JobResult(
        text="hello",
        token_ids=[1, 2],
        finish_reason="length",
        usage=Usage(prompt_tokens=1, completion_tokens=2, total_tokens=3),
    )
    return job.model_copy(update={"status": JobStatus.SUCCEEDED, "result": result})


def test_the_last_chunk_usage_and_done_leave_in_one_write() -> None:
    """Each write crosses every ASGI middleware and the socket: the text goes as it comes,
    one write per delta, and the stream's end (finish reason, usage, ``[DONE]``) in one."""
    done = _finished(new_job(status=JobStatus.RUNNING))
    writes = _writes(["hel", "lo", done], include_usage=True)
    assert len(writes) == 3, writes
    texts = [_data(_events_of(w)[0])["choices"][0] for w in writes[:2]]
    assert [t["text"] for t in texts] == ["hel", "lo"]
    last, usage, end = _events_of(writes[2])
    assert _data(last)["choices"][0]["finish_reason"] == "length"
    assert _data(usage)["usage"]["total_tokens"] == 3
    assert end == "data: [DONE]"


def test_without_usage_the_end_is_the_last_chunk_and_done() -> None:
    done = _finished(new_job(status=JobStatus.RUNNING))
    writes = _writes(["hello", done], include_usage=False)
    assert len(writes) == 2, writes
    last, end = _events_of(writes[1])
    assert _data(last)["choices"][0]["finish_reason"] == "length"
    assert end == "data: [DONE]"


def test_a_failed_job_ends_with_its_error_event_then_done() -> None:
    failed = new_job(status=JobStatus.FAILED)
    writes = _writes(["par", failed], include_usage=True)
    events = [event for write in writes for event in _events_of(write)]
    assert len(events) == 3, events
    assert '"error"' in events[1]
    assert events[2] == "data: [DONE]"
    assert sum(write.count(b"[DONE]") for write in writes) == 1


def test_a_client_that_leaves_once_it_has_done_does_not_cancel_its_job(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """The end is written after the follower's loop: a client closing the stream as soon as
    it has ``[DONE]`` (the server then closes the generator at that write) is not taken for
    one that left early, whose job would be cancelled."""
    abandoned: list[str] = []
    monkeypatch.setattr(openai, "_abandon", lambda call, job: abandoned.append(job.id))
    job = new_job(status=JobStatus.RUNNING)

    async def leave_at_done() -> None:
        events = _stream(job, ["hello", _finished(job)])
        async for write in events:
            if b"[DONE]" in write:
                await events.aclose()
                return

    asyncio.run(leave_at_done())
    assert abandoned == []


_AWKWARD = [
    "plain",
    'a "quote" and a \\ backslash',
    "line\nbreak\ttab",
    "caf\u00e9 \u2603 \U0001f600",
    "nul \x00 and </script>",
    openai._MARK,
    "",
]


@pytest.mark.parametrize("kind", [openai._TEXT, openai._CHAT], ids=["completion", "chat"])
@pytest.mark.parametrize("model", ["a", openai._MARK], ids=["plain", "holds-the-mark"])
def test_a_delta_chunk_is_the_chunk_built_whole_byte_for_byte(
    kind: Any, model: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Each delta is written into a chunk encoded once per stream (only its text is encoded
    per delta); what leaves must be exactly the chunk encoded whole, whatever the text holds,
    and whatever the model's name is (the mark itself: each chunk is then built whole)."""
    job = new_job(status=JobStatus.RUNNING)
    encoded = 0  # chunks encoded whole
    sse = openai._sse

    def counted(data: Any) -> bytes:
        nonlocal encoded
        encoded += 1
        return sse(data)

    monkeypatch.setattr(openai, "_sse", counted)

    async def collect() -> list[bytes]:
        return [w async for w in _stream(job, [*_AWKWARD, _finished(job)], kind=kind, model=model)]

    writes = asyncio.run(collect())
    opening = 1 if kind.opening is not None else 0
    deltas = writes[opening : opening + len(_AWKWARD)]
    head = {"id": f"{kind.id_prefix}{job.id}", "object": kind.chunk_object, "created": 0}
    for text, write in zip(_AWKWARD, deltas, strict=True):
        choice = {"index": 0, "finish_reason": None} | kind.delta(text)
        whole = head | {"model": model, "choices": [choice]}
        assert write == b"data: " + json.dumps(whole, separators=(",", ":")).encode() + b"\n\n"
        assert _data(_events_of(write)[0]) == whole
    if model == openai._MARK:
        assert encoded >= len(_AWKWARD)  # each delta's chunk built whole
    else:
        # The template, the opening (chat), the end and [DONE]: none per delta.
        assert encoded == 3 + (kind.opening is not None)
