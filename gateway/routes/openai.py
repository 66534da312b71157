"""OpenAI-compatible endpoints: ``/v1/models``, ``/v1/completions``, ``/v1/chat/completions``.

A completion is a job like any other (same admission, limits, queue, worker); these routes
wait for it (``completion_timeout_s``) or stream its text as Server-Sent Events in OpenAI's
chunk format. Every answer names the weights that produced it: the ``lorafleet`` field and
the ``x-lorafleet-revision`` / ``x-lorafleet-job-id`` headers.
"""

from __future__ import annotations

import asyncio
import json
import logging
import time
import uuid
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass
from typing import Annotated, Any

from fastapi import APIRouter, Depends, Request
from fastapi.responses import JSONResponse, Response, StreamingResponse
from pydantic import BaseModel, ValidationError
from redis.asyncio import Redis
from redis.exceptions import RedisError

from contracts.errors import ErrorBody, ErrorCode
from contracts.jobs import JobPublic, JobStatus, Sampling
from contracts.registry import AdapterRecord
from contracts.storage import stored_result
from gateway import job_store
from gateway.access import Access
from gateway.auth import ModelAccessDep, TenantDep
from gateway.config import GatewaySettings
from gateway.deps import RedisDep
from gateway.errors import (
    ADMISSION,
    AUTHENTICATED,
    ApiError,
    ErrorEnvelope,
    ErrorEnvelopeBody,
    error_type,
    invalid,
    responses,
    shown,
    unavailable,
)
from gateway.idempotency import fingerprint
from gateway.metrics import GatewayMetrics
from gateway.openai_schemas import (
    DEFAULT_MAX_TOKENS,
    ChatCompletion,
    ChatCompletionCreate,
    Completion,
    CompletionCreate,
    ModelCard,
    ModelList,
    OpenAIRequest,
    chat_completion_of,
    completion_of,
    info_of,
)
from gateway.registry import granted_models
from gateway.result_store import ResultReader
from gateway.routes.jobs import IdempotencyKeyHeader
from gateway.streams import StreamDiverged, StreamHub
from gateway.submit import Idempotency, Submission, Submitter
from gateway.waiter import JobWaiter

router = APIRouter(prefix="/v1", tags=["openai"])
log = logging.getLogger(__name__)

_JOB_FAILED = (
    ErrorCode.DEADLINE_EXCEEDED,
    ErrorCode.CANCELLED,
    ErrorCode.ADAPTER_INTEGRITY,
    ErrorCode.ADAPTER_UNAVAILABLE,
    ErrorCode.ADAPTER_LOAD_FAILED,
    ErrorCode.BASE_MODEL_MISMATCH,
    ErrorCode.ENGINE_ERROR,
    ErrorCode.ATTEMPTS_EXHAUSTED,
    ErrorCode.INTERNAL_ERROR,
)
_COMPLETION_ERRORS = responses(
    *ADMISSION, ErrorCode.UNSUPPORTED_PARAMETER, ErrorCode.TIMEOUT, *_JOB_FAILED
)


@router.get("/models", response_model=ModelList, responses=responses(*AUTHENTICATED))
async def list_models(tenant: TenantDep, redis: RedisDep) -> ModelList:
    """The aliases and channels this tenant may name as ``model``."""
    try:
        models = await granted_models(redis, tenant.name)
    except (RedisError, OSError) as exc:
        raise unavailable("the registry is unreachable", exc, _NOT_LISTED) from exc
    return ModelList(data=[_card(name, record) for name, record in models])


@router.get(
    "/models/{model}",
    response_model=ModelCard,
    responses=responses(*AUTHENTICATED, ErrorCode.ADAPTER_NOT_FOUND),
)
async def get_model(model: str, tenant: TenantDep, redis: RedisDep) -> ModelCard:
    try:
        models = dict(await granted_models(redis, tenant.name))
    except (RedisError, OSError) as exc:
        raise unavailable("the registry is unreachable", exc, _NOT_LISTED) from exc
    if model not in models:
        raise ApiError(
            404,
            ErrorCode.ADAPTER_NOT_FOUND,
            f"No adapter named {shown(model)} is available.",
            param="model",
        )
    return _card(model, models[model])


_NOT_LISTED = "The models could not be listed: {what} ({exc}); retry."
_NOT_READ = "The job was accepted but its result could not be read: {what} ({exc})."


def _card(name: str, record: AdapterRecord) -> ModelCard:
    # As vLLM's server describes a LoRA module: ``root`` where its weights come from (here
    # the content-addressed revision), ``parent`` the base model.
    return ModelCard(
        id=name,
        created=int(record.created_at.timestamp()),
        owned_by="lorafleet",
        root=record.digest,
        parent=record.base_model.id,
    )


@dataclass
class _Call:
    """What every completion request needs besides its body."""

    request: Request
    access: Access
    submitter: Submitter
    redis: Redis
    waiter: JobWaiter
    streams: StreamHub
    settings: GatewaySettings
    metrics: GatewayMetrics
    results: ResultReader
    idempotency_key: str | None = None


async def _call(
    request: Request, access: ModelAccessDep, idempotency_key: IdempotencyKeyHeader = None
) -> _Call:
    # The process's objects straight from ``app.state`` (as ``gateway.deps`` reads them),
    # not as dependencies of their own: FastAPI's solving of them cost every completion
    # about 25 us.
    state = request.app.state
    return _Call(
        request,
        access,
        state.submitter,
        state.redis,
        state.waiter,
        state.streams,
        state.settings,
        state.metrics,
        state.results,
        idempotency_key,
    )


CallDep = Annotated[_Call, Depends(_call)]

CLIENT_CLOSED_REQUEST = 499
_abandoning: set[asyncio.Task[None]] = set()  # strong references until each cancel is written


def _abandon(call: _Call, job: JobPublic) -> None:
    """The caller went away before its completion: cancel the job, as vLLM's server aborts a
    request whose client disconnects (the engine stops generating for nobody). Runs on its
    own: the request's task is being torn down."""

    async def cancel() -> None:
        try:
            async with asyncio.timeout(call.settings.redis_timeout_s):
                _, cancelled = await job_store.cancel_job(
                    call.redis, job.id, job.tenant, call.settings.job_ttl_s
                )
        except (RedisError, OSError, TimeoutError) as exc:
            log.warning("job %s: client gone, but the cancel was not written: %s", job.id, exc)
            return
        if cancelled:
            call.metrics.job_cancelled(job.tier)
            log.info("job %s cancelled: its client disconnected", job.id)

    task = asyncio.get_running_loop().create_task(cancel())
    _abandoning.add(task)
    task.add_done_callback(_abandoning.discard)


async def _disconnected(request: Request) -> None:
    """Returns once the client has closed its connection (the body is read already)."""
    while (await request.receive())["type"] != "http.disconnect":
        pass


@router.post("/completions", response_model=Completion, responses=_COMPLETION_ERRORS)
async def create_completion(body: CompletionCreate, call: CallDep) -> Any:
    """A completion of ``prompt`` by adapter ``model`` (``stream: true``: Server-Sent Events)."""
    body.check()
    submission = Submission(
        adapter=body.model,
        prompt=body.text,
        sampling=_sampling(body),
        deadline_s=body.deadline_s,
        stream=body.stream,
        adapter_field="model",
    )
    return await _complete(call, "/v1/completions", body, submission, _TEXT)


@router.post("/chat/completions", response_model=ChatCompletion, responses=_COMPLETION_ERRORS)
async def create_chat_completion(body: ChatCompletionCreate, call: CallDep) -> Any:
    """The assistant's reply to ``messages``, rendered with the base model's chat template
    (``stream: true``: Server-Sent Events)."""
    body.check()
    submission = Submission(
        adapter=body.model,
        messages=[message.rendered() for message in body.messages],
        sampling=_sampling(body),
        deadline_s=body.deadline_s,
        stream=body.stream,
        adapter_field="model",
    )
    return await _complete(call, "/v1/chat/completions", body, submission, _CHAT)


def _sampling(body: OpenAIRequest) -> Sampling:
    try:
        return body.sampling(DEFAULT_MAX_TOKENS)
    except ValidationError as exc:
        raise invalid(exc) from exc


@dataclass(frozen=True)
class _Kind:
    """How one endpoint words its answers."""

    id_prefix: str
    chunk_object: str
    whole: Callable[[JobPublic, str, int], BaseModel]
    delta: Callable[[str], dict[str, Any]]
    opening: dict[str, Any] | None


_TEXT = _Kind(
    id_prefix="cmpl-",
    chunk_object="text_completion",
    whole=completion_of,
    delta=lambda text: {"text": text},
    opening=None,
)
_CHAT = _Kind(
    id_prefix="chatcmpl-",
    chunk_object="chat.completion.chunk",
    whole=chat_completion_of,
    delta=lambda text: {"delta": {"content": text}},
    opening={"delta": {"role": "assistant", "content": ""}},
)


def _audit_headers(job: JobPublic) -> dict[str, str]:
    return {"x-lorafleet-job-id": job.id, "x-lorafleet-revision": job.revision}


_FAILED_STATUS = {ErrorCode.DEADLINE_EXCEEDED: 504, ErrorCode.CANCELLED: 409}


def _job_error(job: JobPublic | None, job_id: str, timeout_s: float) -> ApiError:
    """Why a job gave no completion, as an API error."""
    if job is None or not job.status.terminal:
        return ApiError(
            504,
            ErrorCode.TIMEOUT,
            f"Job {job_id} did not finish within {timeout_s:g} s; it keeps running: "
            f"GET /v1/jobs/{job_id} for its result.",
        )
    error = job.error or ErrorBody(code=ErrorCode.INTERNAL_ERROR, message="no error recorded")
    return ApiError(
        _FAILED_STATUS.get(error.code, 500),
        error.code,
        f"Job {job_id} {job.status.value}: {error.message}",
    )


async def _complete(
    call: _Call, route: str, body: OpenAIRequest, submission: Submission, kind: _Kind
) -> Any:
    idempotency = None
    if call.idempotency_key is not None:
        idempotency = Idempotency(
            call.idempotency_key, fingerprint(route, body.model_dump(mode="json"))
        )
    # Listening for the job's end from before it exists: no event can be missed, so its
    # record is read at most once, when it has ended, and not at all when it comes on this
    # process's reply channel (a stream's follower has it from the stream's end marker).
    job_id, ended = uuid.uuid4().hex, asyncio.Event()
    reply_to = None if body.stream else call.waiter.replies
    with call.waiter.notifying(job_id, ended.set):
        admitted = await call.submitter.submit(
            call.access, submission, idempotency, job_id, reply_to
        )
        job, created = admitted.job, int(time.time())
        timeout_s = call.settings.completion_timeout_s
        if body.stream:
            opened = not admitted.replayed  # admitted here, its stream opened with it
            events = _events(call, job, body, kind, created, timeout_s, opened)
            return StreamingResponse(
                events, media_type="text/event-stream", headers=_audit_headers(job)
            )
        waiting = asyncio.ensure_future(
            call.waiter.wait(call.redis, job.id, job.tenant, timeout_s)
            if admitted.replayed  # an earlier request's job, not the one watched
            else call.waiter.wait_watched(call.redis, job.id, job.tenant, timeout_s, ended, True)
        )
        gone = asyncio.ensure_future(_disconnected(call.request))
        try:
            await asyncio.wait({waiting, gone}, return_when=asyncio.FIRST_COMPLETED)
        finally:
            gone.cancel()
            if not waiting.done():
                waiting.cancel()
                _abandon(call, job)
    if not waiting.done():
        # Nobody to answer; 499 (nginx's "client closed request") only reaches access logs.
        return Response(status_code=CLIENT_CLOSED_REQUEST)
    try:
        finished = waiting.result()
    except (RedisError, OSError) as exc:
        raise unavailable(f"job {job.id}: the job store is unreachable", exc, _NOT_READ) from exc
    if finished is None or finished.status != JobStatus.SUCCEEDED:
        error = _job_error(finished, job.id, timeout_s)
        error.headers = _audit_headers(job)
        raise error
    try:
        finished = await call.results.read(finished)
    except ApiError as error:
        error.headers = (error.headers or {}) | _audit_headers(job)
        raise
    return JSONResponse(
        kind.whole(finished, body.model, created).model_dump(mode="json"),
        headers=_audit_headers(job),
    )


def _sse(data: dict[str, Any] | str) -> bytes:
    payload = data if isinstance(data, str) else json.dumps(data, separators=(",", ":"))
    return f"data: {payload}\n\n".encode()


def _error_event(error: ApiError) -> bytes:
    envelope = ErrorEnvelope(
        error=ErrorEnvelopeBody(
            code=error.code, message=error.message, type=error_type(error.status_code)
        )
    )
    return _sse(envelope.model_dump(mode="json", exclude_none=True))


_MARK = "\x00lorafleet-delta\x00"
_MARK_JSON = json.dumps(_MARK).encode()


def _delta_chunks(chunk: Callable[[dict[str, Any]], bytes], kind: _Kind) -> Callable[[str], bytes]:
    """``chunk(kind.delta(text))`` as a function of ``text``: the chunk is written once
    around a mark, and each delta only JSON-encodes its text into it (a stream sends tens
    of deltas; this takes a tenth of the time of building and encoding the chunk anew)."""
    template = chunk(kind.delta(_MARK))
    before, found, after = template.partition(_MARK_JSON)
    if not found or _MARK_JSON in after:  # the mark is in the head too: build each anew
        return lambda text: chunk(kind.delta(text))
    return lambda text: before + json.dumps(text).encode() + after


async def _events(
    call: _Call,
    job: JobPublic,
    body: OpenAIRequest,
    kind: _Kind,
    created: int,
    timeout_s: float,
    opened: bool,
) -> AsyncIterator[bytes]:
    """OpenAI's chunk stream: the text as it is produced, a last chunk with the finish
    reason (and ``lorafleet``), a usage chunk if asked for, then ``[DONE]``. A failure after
    the stream started arrives as an error event, which OpenAI clients raise. ``opened``:
    the job's stream was opened when it was admitted (``StreamHub.follow``)."""
    head = {"id": f"{kind.id_prefix}{job.id}", "object": kind.chunk_object, "created": created}
    head["model"] = body.model

    def chunk(choice: dict[str, Any] | None, **extra: Any) -> bytes:
        choices = [] if choice is None else [{"index": 0, "finish_reason": None} | choice]
        return _sse(head | {"choices": choices} | extra)

    delta = _delta_chunks(chunk, kind)
    if kind.opening is not None:
        yield chunk(kind.opening)
    end = b""
    try:
        async for item in call.streams.follow(job, timeout_s, opened):
            if isinstance(item, str):
                yield delta(item)
                continue
            # The text came as deltas; the end needs only what a stored result's reference
            # keeps too (an object store that is down does not break the stream).
            ending = item.result or stored_result(item)
            if item.status != JobStatus.SUCCEEDED or ending is None:
                yield _error_event(_job_error(item, job.id, timeout_s))
                break
            last = kind.delta("") | {"finish_reason": ending.finish_reason}
            # Sent with [DONE] in one write (each write crosses every middleware and the
            # socket), after the loop: the job is the follower's last item (a follower left
            # unfinished is closed by a task of its own), and a client that leaves once it
            # has [DONE] is not mistaken for one that left early.
            end = chunk(last, lorafleet=info_of(item).model_dump(mode="json"))
            if body.include_usage:
                end += chunk(None, usage=ending.usage.model_dump())
    except StreamDiverged:
        yield _error_event(
            ApiError(
                500,
                ErrorCode.INTERNAL_ERROR,
                f"Job {job.id} was restarted after a worker failure and its new attempt "
                f"produced different text; GET /v1/jobs/{job.id} for the final result.",
            )
        )
    except (RedisError, OSError) as exc:
        yield _error_event(
            unavailable(f"job {job.id}: the job store is unreachable", exc, _NOT_READ)
        )
    except BaseException:
        # Torn down before the job's end reached the caller: its client disconnected (the
        # server cancels this generator) or closed the stream. Nobody reads on: cancel it.
        _abandon(call, job)
        raise
    yield end + _sse("[DONE]")
