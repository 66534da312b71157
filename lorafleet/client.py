"""Clients of the gateway: ``Client`` and ``AsyncClient`` for users (jobs, batches, the fleet;
typed results and errors; retries that honour ``Retry-After``; idempotency keys on creates),
``verify_webhook`` for receivers, and ``JobsClient``, the small job client the demo, tests and
benchmarks use."""

from __future__ import annotations

import asyncio
import contextlib
import hmac
import json
import time
import uuid
from collections.abc import (
    AsyncGenerator,
    Awaitable,
    Callable,
    Iterable,
    Iterator,
    Mapping,
)
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any, TypeVar

import httpx

from contracts.batches import BatchPublic
from contracts.errors import ErrorCode
from contracts.jobs import JobAccepted, JobPublic
from contracts.webhooks import signature

if TYPE_CHECKING:
    from gateway.fleet import Fleet

T = TypeVar("T")

LONG_POLL_S = 20.0


def auth_headers(api_key: str) -> dict[str, str]:
    return {"Authorization": f"Bearer {api_key}"}


class GatewayError(Exception):
    """A refusal by the gateway: the HTTP ``status_code``, the stable ``code`` (an
    ``ErrorCode``; the raw string for a code this client does not know), the human
    ``message``, ``details`` (per-line or per-field, when given), ``retry_after_s`` (from
    ``Retry-After``) and the whole ``body``. Subclasses by kind: ``InvalidRequest``,
    ``Unauthorized``, ``NotFound``, ``Conflict``, ``RateLimited``, ``Unavailable``."""

    def __init__(
        self, status_code: int, body: dict[str, Any], retry_after_s: float | None = None
    ) -> None:
        error = body.get("error", {}) if isinstance(body, dict) else {}
        if not isinstance(error, dict):
            error = {"code": "internal_error", "message": str(error)}
        super().__init__(f"{status_code} {error.get('code')}: {error.get('message')}")
        self.status_code = status_code
        raw = str(error.get("code") or "internal_error")
        self.code: ErrorCode | str = ErrorCode(raw) if raw in _CODES else raw
        self.message = str(error.get("message", ""))
        self.details: list[dict[str, Any]] | None = error.get("details")
        self.retry_after_s = retry_after_s
        self.body = body


class InvalidRequest(GatewayError):
    """400, 413, 415, 422: fix the request; retrying it as is fails again."""


class Unauthorized(GatewayError):
    """401, 403: no key, a wrong key, or a key that may not do this."""


class NotFound(GatewayError):
    """404, 410: no such job, batch, file or adapter (410: retired)."""


class Conflict(GatewayError):
    """409: the resource is not in a state that allows this (a finished job, ...)."""


class RateLimited(GatewayError):
    """429: a limit refused it now; ``retry_after_s`` says when to try again."""


class Unavailable(GatewayError):
    """503 and other 5xx: the service could not take it now (nothing was admitted)."""


LorafleetError = GatewayError
_CODES = {code.value for code in ErrorCode}
_KINDS: dict[int, type[GatewayError]] = {
    400: InvalidRequest,
    401: Unauthorized,
    403: Unauthorized,
    404: NotFound,
    409: Conflict,
    410: NotFound,
    413: InvalidRequest,
    415: InvalidRequest,
    422: InvalidRequest,
    429: RateLimited,
}


def error_from(response: httpx.Response) -> GatewayError:
    """The typed error of a refused request."""
    try:
        body = response.json()
    except ValueError:
        body = {"error": {"code": "internal_error", "message": response.text[:500]}}
    kind = _KINDS.get(
        response.status_code, Unavailable if response.status_code >= 500 else InvalidRequest
    )
    return kind(response.status_code, body, _retry_after(response))


def _retry_after(response: httpx.Response) -> float | None:
    try:
        return max(0.0, float(response.headers["Retry-After"]))
    except (KeyError, ValueError):
        return None


class JobsClient:
    def __init__(self, http: httpx.AsyncClient) -> None:
        self._http = http

    async def submit(
        self, adapter: str, prompt: str, sampling: dict[str, Any] | None = None
    ) -> JobAccepted:
        body: dict[str, Any] = {"adapter": adapter, "prompt": prompt}
        if sampling is not None:
            body["sampling"] = sampling
        response = await self._http.post("/v1/jobs", json=body)
        if response.status_code != 202:
            raise error_from(response)
        return JobAccepted.model_validate(response.json())

    async def get(self, job_id: str, wait_s: float = 0.0) -> JobPublic:
        """The job now, or once finished if that happens within ``wait_s`` (long-poll).

        A GET is safe to repeat: one retry covers a pooled connection the server closed
        just as it was reused.
        """
        params = {"wait_s": wait_s}
        try:
            response = await self._http.get(f"/v1/jobs/{job_id}", params=params)
        except httpx.TransportError:
            response = await self._http.get(f"/v1/jobs/{job_id}", params=params)
        if response.status_code != 200:
            raise error_from(response)
        return JobPublic.model_validate(response.json())

    async def wait(self, job_id: str, timeout_s: float = 300.0) -> JobPublic:
        """Long-poll until the job is terminal; raises ``TimeoutError`` past ``timeout_s``."""
        deadline = time.monotonic() + timeout_s
        while True:
            remaining = deadline - time.monotonic()
            job = await self.get(job_id, wait_s=max(0.0, min(LONG_POLL_S, remaining)))
            if job.status.terminal:
                return job
            if time.monotonic() >= deadline:
                raise TimeoutError(f"job {job_id} still {job.status} after {timeout_s} s")

    async def run(
        self,
        adapter: str,
        prompt: str,
        sampling: dict[str, Any] | None = None,
        timeout_s: float = 300.0,
    ) -> JobPublic:
        accepted = await self.submit(adapter, prompt, sampling)
        return await self.wait(accepted.id, timeout_s)


Progress = Callable[[BatchPublic], None]
"""Called with the batch each time ``wait_batch`` reads it."""


@dataclass(frozen=True)
class _Call:
    method: str
    path: str
    json: Any = None
    content: bytes | None = None
    params: dict[str, Any] | None = None
    headers: dict[str, str] = field(default_factory=dict)
    ok: tuple[int, ...] = (200,)
    safe: bool = False
    """Safe to send again after a transport error (a read, or a job create with its key)."""
    wait_s: float = 0.0
    """Server-side wait (a long-poll): added to the request's timeout."""


def _stack_defaults(gateway: str | None, key: str | None) -> tuple[str, str]:
    """``gateway`` and ``key``, or the local stack's (``.lorafleet/stack.json``)."""
    if gateway and key:
        return gateway, key
    from lorafleet.settings import LocalSettings

    path = LocalSettings().stack_file
    try:
        state = json.loads(path.read_text())
    except (OSError, ValueError) as exc:
        raise ValueError(
            f"no gateway given and no local stack to use ({path}: {exc}); pass gateway= and "
            "key=, or start one: lorafleet stack up"
        ) from None
    return gateway or state["gateway_url"], key or state["api_key"]


def _job_body(
    adapter: str,
    prompt: str,
    sampling: dict[str, Any] | None,
    deadline_s: float | None,
    webhook_url: str | None,
) -> dict[str, Any]:
    body: dict[str, Any] = {"adapter": adapter, "prompt": prompt}
    if sampling is not None:
        body["sampling"] = sampling
    if deadline_s is not None:
        body["deadline_s"] = deadline_s
    if webhook_url is not None:
        body["webhook"] = {"url": webhook_url}
    return body


def _batch_call(
    requests: Iterable[dict[str, Any]] | str | Path,
    webhook_url: str | None,
    deadline_s: float | None,
    idempotency_key: str | None,
) -> _Call:
    """A batch from a list of job bodies (JSON), or a JSONL file of them or of OpenAI's batch
    lines (sent as is: the gateway detects the shape). It carries an idempotency key, so it
    is safe to send again after a transport error: the gateway admits it once."""
    headers = {"Idempotency-Key": idempotency_key or uuid.uuid4().hex}
    if isinstance(requests, (str, Path)):
        params = {"webhook_url": webhook_url, "deadline_s": deadline_s}
        return _Call(
            "POST",
            "/v1/batches",
            content=Path(requests).read_bytes(),
            params={k: v for k, v in params.items() if v is not None},
            headers={**headers, "Content-Type": "application/jsonl"},
            ok=(200, 202),
            safe=True,
        )
    body: dict[str, Any] = {"requests": list(requests)}
    if webhook_url is not None:
        body["webhook"] = {"url": webhook_url}
    if deadline_s is not None:
        body["deadline_s"] = deadline_s
    return _Call("POST", "/v1/batches", json=body, headers=headers, ok=(200, 202), safe=True)


class AsyncClient:
    """The gateway's API for Python callers (asyncio). ``gateway`` and ``key`` default to the
    local stack's. A refusal raises a ``GatewayError`` subclass carrying its stable ``code``;
    429 and 503 are retried up to ``max_retries`` times, waiting what ``Retry-After`` says
    (at most ``max_wait_s`` each time), and so are transport errors of requests that are safe
    to repeat (reads, cancels, and job and batch creates: each carries an idempotency key,
    generated unless given)."""

    def __init__(
        self,
        gateway: str | None = None,
        key: str | None = None,
        *,
        timeout_s: float = 60.0,
        max_retries: int = 3,
        max_wait_s: float = 30.0,
        transport: httpx.AsyncBaseTransport | None = None,
    ) -> None:
        """``transport``: httpx's, for a proxy of your own or a test's."""
        if max_retries < 0:
            raise ValueError("max_retries must be 0 or more")
        url, api_key = _stack_defaults(gateway, key)
        self._timeout_s = timeout_s
        self._http = httpx.AsyncClient(
            base_url=url, headers=auth_headers(api_key), timeout=timeout_s, transport=transport
        )
        self._max_retries = max_retries
        self._max_wait_s = max_wait_s

    async def __aenter__(self) -> AsyncClient:
        return self

    async def __aexit__(self, *_: object) -> None:
        await self.close()

    async def close(self) -> None:
        await self._http.aclose()

    async def _send(self, call: _Call) -> httpx.Response:
        for attempt in range(self._max_retries + 1):
            last = attempt == self._max_retries
            try:
                response = await self._http.request(
                    call.method,
                    call.path,
                    json=call.json,
                    content=call.content,
                    params=call.params,
                    headers=call.headers,
                    timeout=self._timeout_s + call.wait_s,
                )
            except httpx.TransportError:
                if not call.safe or last:
                    raise
                await asyncio.sleep(min(self._max_wait_s, 0.5 * 2**attempt))
                continue
            if response.status_code in call.ok:
                return response
            error = error_from(response)
            if response.status_code not in (429, 503) or last:
                raise error
            wait = error.retry_after_s if error.retry_after_s is not None else 2**attempt
            await asyncio.sleep(min(self._max_wait_s, wait))
        raise AssertionError("unreachable")

    async def create_job(
        self,
        adapter: str,
        prompt: str,
        *,
        sampling: dict[str, Any] | None = None,
        deadline_s: float | None = None,
        webhook_url: str | None = None,
        idempotency_key: str | None = None,
    ) -> JobAccepted:
        """Admit a job (``POST /v1/jobs``); the same ``idempotency_key`` again returns the
        job it admitted first."""
        body = _job_body(adapter, prompt, sampling, deadline_s, webhook_url)
        headers = {"Idempotency-Key": idempotency_key or uuid.uuid4().hex}
        call = _Call("POST", "/v1/jobs", json=body, headers=headers, ok=(200, 202), safe=True)
        return JobAccepted.model_validate((await self._send(call)).json())

    async def get_job(self, job_id: str, wait_s: float = 0.0) -> JobPublic:
        """The job now, or once it has ended if that happens within ``wait_s`` (long-poll)."""
        call = _Call(
            "GET", f"/v1/jobs/{job_id}", params={"wait_s": wait_s}, safe=True, wait_s=wait_s
        )
        return JobPublic.model_validate((await self._send(call)).json())

    async def wait_job(self, job_id: str, timeout_s: float = 300.0) -> JobPublic:
        """Long-poll until the job has ended; ``TimeoutError`` past ``timeout_s``."""
        deadline = time.monotonic() + timeout_s
        while True:
            remaining = max(0.0, deadline - time.monotonic())
            job = await self.get_job(job_id, wait_s=min(LONG_POLL_S, remaining))
            if job.status.terminal:
                return job
            if time.monotonic() >= deadline:
                raise TimeoutError(f"job {job_id} still {job.status} after {timeout_s} s")

    async def cancel_job(self, job_id: str) -> JobPublic:
        """Cancel a queued or running job (``Conflict`` once it has ended)."""
        call = _Call("DELETE", f"/v1/jobs/{job_id}", safe=True)
        return JobPublic.model_validate((await self._send(call)).json())

    async def create_batch(
        self,
        requests: Iterable[dict[str, Any]] | str | Path,
        *,
        webhook_url: str | None = None,
        deadline_s: float | None = None,
        idempotency_key: str | None = None,
    ) -> BatchPublic:
        """Admit every job of a batch or none: ``requests`` is a list of job bodies
        (``{"adapter", "prompt", "sampling"?}``) or the path of a JSONL file of them. The
        same ``idempotency_key`` again returns the batch it admitted first."""
        call = _batch_call(requests, webhook_url, deadline_s, idempotency_key)
        return BatchPublic.model_validate((await self._send(call)).json())

    async def create_openai_batch(self, path: str | Path, endpoint: str) -> BatchPublic:
        """OpenAI's Batch API: upload ``path`` (a JSONL of ``{"custom_id", "method", "url",
        "body"}`` lines to ``endpoint``) and run it as a batch."""
        name = Path(path).name
        upload = await self._http.post(
            "/v1/files",
            files={"file": (name, Path(path).read_bytes(), "application/jsonl")},
            data={"purpose": "batch"},
        )
        if upload.status_code != 200:
            raise error_from(upload)
        body = {"input_file_id": upload.json()["id"], "endpoint": endpoint}
        headers = {"Idempotency-Key": uuid.uuid4().hex}
        call = _Call("POST", "/v1/batches", json=body, headers=headers, ok=(200, 202), safe=True)
        return BatchPublic.model_validate((await self._send(call)).json())

    async def get_batch(self, batch_id: str) -> BatchPublic:
        call = _Call("GET", f"/v1/batches/{batch_id}", safe=True)
        return BatchPublic.model_validate((await self._send(call)).json())

    async def wait_batch(
        self,
        batch_id: str,
        *,
        timeout_s: float = 3600.0,
        poll_s: float = 1.0,
        progress: Progress | None = None,
    ) -> BatchPublic:
        """Until the batch has ended (``completed`` or ``cancelled``), calling ``progress``
        with each reading; ``TimeoutError`` past ``timeout_s``."""
        deadline = time.monotonic() + timeout_s
        while True:
            batch = await self.get_batch(batch_id)
            if progress is not None:
                progress(batch)
            if batch.status in ("completed", "cancelled"):
                return batch
            if time.monotonic() >= deadline:
                raise TimeoutError(f"batch {batch_id} still {batch.status} after {timeout_s} s")
            await asyncio.sleep(poll_s)

    async def batch_results(self, batch_id: str) -> AsyncGenerator[dict[str, Any]]:
        """The batch's result lines (one per request, in input order), as they stream."""
        async with self._http.stream("GET", f"/v1/batches/{batch_id}/results") as response:
            if response.status_code != 200:
                await response.aread()
                raise error_from(response)
            async for line in response.aiter_lines():
                if line.strip():
                    yield json.loads(line)

    async def cancel_batch(self, batch_id: str) -> BatchPublic:
        call = _Call("DELETE", f"/v1/batches/{batch_id}", safe=True)
        return BatchPublic.model_validate((await self._send(call)).json())

    async def fleet(self) -> Fleet:
        """Pool queues, workers and recommended replicas (an operator's key)."""
        from gateway.fleet import Fleet

        return Fleet.model_validate((await self._send(_Call("GET", "/v1/fleet", safe=True))).json())


class Client:
    """``AsyncClient``'s calls, blocking: each runs on a private event loop (one thread)."""

    def __init__(
        self,
        gateway: str | None = None,
        key: str | None = None,
        *,
        timeout_s: float = 60.0,
        max_retries: int = 3,
        max_wait_s: float = 30.0,
    ) -> None:
        self._loop = asyncio.new_event_loop()
        self._async = AsyncClient(
            gateway, key, timeout_s=timeout_s, max_retries=max_retries, max_wait_s=max_wait_s
        )

    def __enter__(self) -> Client:
        return self

    def __exit__(self, *_: object) -> None:
        self.close()

    def close(self) -> None:
        if not self._loop.is_closed():
            self._loop.run_until_complete(self._async.close())
            self._loop.close()

    def _run(self, call: Awaitable[T]) -> T:
        """``call`` on the private loop; interrupted (Ctrl-C), it is cancelled and finished
        before the interruption goes on, so the loop is left with nothing running."""
        task = asyncio.ensure_future(call, loop=self._loop)
        try:
            return self._loop.run_until_complete(task)
        except BaseException:
            if not task.done():
                task.cancel()
                with contextlib.suppress(BaseException):
                    self._loop.run_until_complete(task)
            raise

    def create_job(
        self,
        adapter: str,
        prompt: str,
        *,
        sampling: dict[str, Any] | None = None,
        deadline_s: float | None = None,
        webhook_url: str | None = None,
        idempotency_key: str | None = None,
    ) -> JobAccepted:
        return self._run(
            self._async.create_job(
                adapter,
                prompt,
                sampling=sampling,
                deadline_s=deadline_s,
                webhook_url=webhook_url,
                idempotency_key=idempotency_key,
            )
        )

    def get_job(self, job_id: str, wait_s: float = 0.0) -> JobPublic:
        return self._run(self._async.get_job(job_id, wait_s))

    def wait_job(self, job_id: str, timeout_s: float = 300.0) -> JobPublic:
        return self._run(self._async.wait_job(job_id, timeout_s))

    def cancel_job(self, job_id: str) -> JobPublic:
        return self._run(self._async.cancel_job(job_id))

    def create_batch(
        self,
        requests: Iterable[dict[str, Any]] | str | Path,
        *,
        webhook_url: str | None = None,
        deadline_s: float | None = None,
        idempotency_key: str | None = None,
    ) -> BatchPublic:
        return self._run(
            self._async.create_batch(
                requests,
                webhook_url=webhook_url,
                deadline_s=deadline_s,
                idempotency_key=idempotency_key,
            )
        )

    def create_openai_batch(self, path: str | Path, endpoint: str) -> BatchPublic:
        return self._run(self._async.create_openai_batch(path, endpoint))

    def get_batch(self, batch_id: str) -> BatchPublic:
        return self._run(self._async.get_batch(batch_id))

    def wait_batch(
        self,
        batch_id: str,
        *,
        timeout_s: float = 3600.0,
        poll_s: float = 1.0,
        progress: Progress | None = None,
    ) -> BatchPublic:
        return self._run(
            self._async.wait_batch(batch_id, timeout_s=timeout_s, poll_s=poll_s, progress=progress)
        )

    def batch_results(self, batch_id: str) -> Iterator[dict[str, Any]]:
        lines = self._async.batch_results(batch_id)
        try:
            while True:
                try:
                    yield self._run(anext(lines))
                except StopAsyncIteration:
                    return
        finally:
            self._run(lines.aclose())

    def cancel_batch(self, batch_id: str) -> BatchPublic:
        return self._run(self._async.cancel_batch(batch_id))

    def fleet(self) -> Fleet:
        return self._run(self._async.fleet())


def verify_webhook(
    headers: Mapping[str, str], body: bytes, secret: str, tolerance_s: float = 300.0
) -> dict[str, Any]:
    """A receiver's check of a lorafleet callback (Standard Webhooks): one of the
    ``webhook-signature`` signatures is ``secret``'s over ``{id}.{timestamp}.{body}``, and the
    timestamp is within ``tolerance_s`` of now. Returns the parsed body; raises
    ``ValueError`` otherwise (answer 400 and ignore the request)."""
    lowered = {name.lower(): value for name, value in headers.items()}
    try:
        event_id = lowered["webhook-id"]
        timestamp = int(lowered["webhook-timestamp"])
        offered = lowered["webhook-signature"].split()
    except (KeyError, ValueError) as exc:
        raise ValueError(f"not a signed webhook: {exc}") from None
    if abs(time.time() - timestamp) > tolerance_s:
        raise ValueError(f"webhook timestamp {timestamp} is outside the {tolerance_s:g} s window")
    expected = signature(secret, event_id, timestamp, body)
    wanted = expected.encode()
    if not any(hmac.compare_digest(wanted, candidate.encode()) for candidate in offered):
        raise ValueError("no webhook signature matches the secret")
    payload: dict[str, Any] = json.loads(body)
    return payload
