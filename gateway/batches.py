"""Batches, gateway side: validate every request first, admit all of them or none, enqueue,
and read them back in submission order.

A batch arrives as lorafleet job requests (JSON ``requests`` or a JSONL body) or as an
uploaded OpenAI batch file (``/v1/completions`` or ``/v1/chat/completions`` lines). One bad
line refuses the whole batch, with every bad line's number and reason; nothing is recorded.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import logging
import time
import uuid
from collections.abc import AsyncIterator
from dataclasses import dataclass
from typing import Any, Literal

from pydantic import (
    BaseModel,
    ConfigDict,
    Field,
    ValidationError,
    ValidationInfo,
    field_validator,
)
from pydantic.json_schema import SkipJsonSchema
from redis.asyncio import Redis
from redis.exceptions import RedisError

from contracts import admission, strict_json
from contracts.batches import BatchEndpoint, BatchLine, BatchPublic, BatchRecord, batch_public
from contracts.errors import ErrorCode
from contracts.job_records import RECORD_FIELDS, job_of
from contracts.jobs import MAX_PROMPT_CHARS, JobMessage, JobPublic, JobStatus, Sampling
from contracts.keys import batch_jobs_key, batch_key, job_key
from contracts.storage import stored_result
from contracts.tenants import TenantRecord
from contracts.webhooks import WebhookTarget, batch_event_id
from gateway import job_store
from gateway.access import Caller
from gateway.config import GatewaySettings
from gateway.errors import ApiError, problem
from gateway.idempotency import IdempotencyKeys, Reservation
from gateway.openai_schemas import DEFAULT_MAX_TOKENS, ChatCompletionCreate, CompletionCreate
from gateway.queue import job_message
from gateway.registry import Resolved
from gateway.result_store import ResultReader
from gateway.routing import destination
from gateway.submit import (
    Idempotency,
    Prepared,
    Submission,
    Submitter,
    admit_then_enqueue,
    refusal_error,
)
from gateway.webhooks import check_target, delivery_status

log = logging.getLogger(__name__)

MAX_LINE_ERRORS = 100
"""A refused batch reports at most this many bad lines (and how many there were)."""

READ_CHUNK = 500
READS_PER_REQUEST = 4
"""Object-store reads one batch's results or output file runs at once."""


class BatchRequest(BaseModel):
    """One request of a lorafleet batch: a job (``POST /v1/jobs`` body) with an id."""

    model_config = ConfigDict(extra="forbid", strict=True)

    custom_id: str | None = Field(default=None, min_length=1, max_length=256)
    adapter: str
    prompt: str = Field(min_length=1, max_length=MAX_PROMPT_CHARS)
    sampling: Sampling = Field(default_factory=Sampling)


class BatchCreate(BaseModel):
    """Body of ``POST /v1/batches`` (lorafleet's shape; or OpenAI's, see ``OpenAIBatchCreate``)."""

    model_config = ConfigDict(extra="forbid", strict=True)

    requests: list[dict[str, Any]] = Field(description="job requests, each validated alone")
    webhook: WebhookTarget | None = None
    deadline_s: float | None = Field(default=None, gt=0)
    metadata: dict[str, str] | None = None


class OpenAIBatchCreate(BaseModel):
    """OpenAI's ``POST /v1/batches``: the requests are in an uploaded file."""

    model_config = ConfigDict(extra="ignore", strict=True)

    input_file_id: str
    endpoint: BatchEndpoint
    completion_window: Literal["24h"] = Field(
        default="24h", description="OpenAI's only window; lorafleet's is each job's deadline"
    )
    metadata: dict[str, str] | None = None
    # lorafleet's own shape (``BatchCreate``): refused beside ``input_file_id``, not dropped
    # (and not part of this shape's schema).
    requests: SkipJsonSchema[Any] = Field(default=None, exclude=True)
    webhook: SkipJsonSchema[Any] = Field(default=None, exclude=True)
    deadline_s: SkipJsonSchema[Any] = Field(default=None, exclude=True)

    @field_validator("requests", "webhook", "deadline_s")
    @classmethod
    def _not_with_a_file(cls, value: Any, info: ValidationInfo) -> None:
        if value is not None:
            raise ValueError(
                f"{info.field_name} belongs to lorafleet's batch shape, not OpenAI's "
                "(input_file_id): send one or the other"
            )
        return None


class OpenAILine(BaseModel):
    model_config = ConfigDict(extra="forbid", strict=True)

    custom_id: str = Field(min_length=1, max_length=256)
    method: str = "POST"
    url: str
    body: dict[str, Any]


@dataclass(frozen=True)
class LineError:
    line: int
    message: str
    code: ErrorCode = ErrorCode.VALIDATION_ERROR

    def detail(self) -> dict[str, object]:
        return {"line": self.line, "code": self.code.value, "message": self.message}


@dataclass(frozen=True)
class Parsed:
    """One valid line: the job to submit and how the line is reported."""

    number: int
    submission: Submission
    custom_id: str
    endpoint: BatchEndpoint
    model: str


def _first_problem(exc: ValidationError) -> str:
    field, message = problem(exc.errors()[0], empty="line")
    return f"{field}: {message}"


def parse_native(item: Any, number: int) -> Parsed | LineError:
    try:
        request = BatchRequest.model_validate(item)
    except ValidationError as exc:
        return LineError(number, _first_problem(exc))
    submission = Submission(
        adapter=request.adapter, prompt=request.prompt, sampling=request.sampling
    )
    custom_id = request.custom_id or str(number)
    return Parsed(number, submission, custom_id, "/v1/jobs", request.adapter)


def parse_openai(item: Any, number: int, endpoint: BatchEndpoint) -> Parsed | LineError:
    try:
        line = OpenAILine.model_validate(item)
    except ValidationError as exc:
        return LineError(number, _first_problem(exc))
    if line.method != "POST" or line.url != endpoint:
        return LineError(number, f"each line must be POST {endpoint} (the batch's endpoint)")
    try:
        if endpoint == "/v1/chat/completions":
            chat = ChatCompletionCreate.model_validate(line.body)
            chat.check()
            sampling, model = chat.sampling(DEFAULT_MAX_TOKENS), chat.model
            submission = Submission(
                adapter=model,
                messages=[message.rendered() for message in chat.messages],
                sampling=sampling,
            )
        else:
            completion = CompletionCreate.model_validate(line.body)
            completion.check()
            submission = Submission(
                adapter=completion.model,
                prompt=completion.text,
                sampling=completion.sampling(DEFAULT_MAX_TOKENS),
            )
    except ValidationError as exc:
        return LineError(number, "body." + _first_problem(exc))
    except ApiError as exc:
        return LineError(number, exc.message, exc.code)
    if (line.body or {}).get("stream"):
        return LineError(number, "body.stream: batch requests can't stream")
    return Parsed(number, submission, line.custom_id, endpoint, submission.adapter)


BOM = b"\xef\xbb\xbf"


def jsonl(content: bytes) -> list[tuple[int, Any] | LineError]:
    """``(line number, value)`` of each non-blank line, or why the line is refused.

    Lines end at ``\n`` (or ``\r\n``) only, never at the other characters ``str.splitlines``
    breaks on; a leading byte-order mark is accepted; a line that is not strict JSON (invalid
    UTF-8 included: never replaced) is refused. Every line is looked at.
    """
    items: list[tuple[int, Any] | LineError] = []
    for number, raw in enumerate(content.removeprefix(BOM).split(b"\n"), 1):
        line = raw.removesuffix(b"\r")
        if not line.strip(b" \t"):
            continue
        try:
            items.append((number, strict_json.loads(line)))
        except strict_json.JsonRefusal as exc:
            items.append(LineError(number, str(exc)))
    return items


def openai_file_errors(content: bytes) -> tuple[list[LineError], int]:
    """Every bad line of an OpenAI batch input file, and how many lines it holds: each line
    must be a request to one of the batch endpoints, valid for that endpoint."""
    errors, items = [], jsonl(content)
    for item in items:
        if isinstance(item, LineError):
            errors.append(item)
            continue
        number, value = item
        url = value.get("url") if isinstance(value, dict) else None
        if url not in ("/v1/completions", "/v1/chat/completions"):
            errors.append(LineError(number, "url: must be /v1/completions or /v1/chat/completions"))
            continue
        parsed = parse_openai(value, number, url)
        if isinstance(parsed, LineError):
            errors.append(parsed)
    return errors, len(items)


def refused(
    errors: list[LineError],
    total: int,
    what: str = "batch lines",
    then: str = "nothing was enqueued",
) -> ApiError:
    shown = errors[:MAX_LINE_ERRORS]
    where = ", ".join(str(e.line) for e in shown[:10]) + ("…" if len(errors) > 10 else "")
    return ApiError(
        422,
        ErrorCode.BATCH_INVALID,
        f"{len(errors)} of {total} {what} are invalid (lines {where}); {then}. Fix them and "
        "submit again.",
        details=[e.detail() for e in shown],
    )


def _check_admissible(tenant: str, jobs: list[JobPublic], limits: admission.BatchLimits) -> None:
    """Refuse, for good, a batch larger than a limit it must fit in whole: retrying it
    would be refused forever, so it gets no ``Retry-After``."""
    why = None
    if len(jobs) > limits.tenant_max:
        why = f"tenant {tenant!r} may hold {limits.tenant_max} unfinished jobs"
    for queue in admission.batch_queues(jobs):
        tier = next(job.tier for job in jobs if job.queue == queue)
        wanted = sum(job.queue == queue for job in jobs)
        if why is None and wanted > limits.tier_max[tier]:
            most = limits.tier_max[tier]
            why = (
                f"{wanted} of them are for the {tier.value} tier of one base model (queue "
                f"{queue}), which holds at most {most}"
            )
    if why is not None:
        raise ApiError(
            422,
            ErrorCode.BATCH_EXCEEDS_LIMITS,
            f"A batch of {len(jobs)} jobs can never be admitted: {why}, and a batch is "
            "admitted whole. Nothing was enqueued; split it into smaller batches.",
        )


REQUEST_CANCEL = """
-- KEYS[1]: the batch's hash. ARGV[1]: now. Marks the batch cancelled unless every job of it
-- has ended already; 1 if the batch is (now or already) being cancelled, 0 if it had ended.
local counts = redis.call('HMGET', KEYS[1], 'finished', 'total')
if tonumber(counts[1] or '0') >= tonumber(counts[2] or '0') then
  return redis.call('HEXISTS', KEYS[1], 'cancel_requested_at')
end
redis.call('HSETNX', KEYS[1], 'cancel_requested_at', ARGV[1])
return 1
"""


class Batches:
    def __init__(
        self,
        redis: Redis,
        submitter: Submitter,
        settings: GatewaySettings,
        results: ResultReader,
    ) -> None:
        self._redis = redis
        self._results = results
        self._admit_script = redis.register_script(admission.ADMIT_BATCH)
        self._withdraw_script = redis.register_script(admission.WITHDRAW_BATCH)
        self._request_cancel = redis.register_script(REQUEST_CANCEL)
        self._submitter = submitter
        self._settings = settings

    async def create(
        self,
        tenant: TenantRecord,
        caller: Caller,
        lines: list[Parsed | LineError],
        endpoint: BatchEndpoint,
        webhook: WebhookTarget | None = None,
        deadline_s: float | None = None,
        metadata: dict[str, str] | None = None,
        input_file_id: str | None = None,
        idempotency: Idempotency | None = None,
    ) -> tuple[BatchPublic, bool]:
        """Check every line, then admit and enqueue all of them, or nothing. Answers the
        batch and whether it is an earlier one, replayed for its ``idempotency`` key (the
        same key and body: nothing new is enqueued)."""
        settings = self._settings
        if not lines:
            raise ApiError(422, ErrorCode.BATCH_INVALID, "The batch holds no requests.")
        if len(lines) > settings.max_batch_requests:
            raise ApiError(
                413,
                ErrorCode.BATCH_TOO_LARGE,
                f"The batch holds {len(lines)} requests; at most {settings.max_batch_requests} "
                "are accepted. Nothing was enqueued; split it.",
            )
        async with self._submitter.bounded(settings.request_timeout_s + 0.01 * len(lines)):
            if webhook is not None:
                await check_target(webhook, settings)
            batch, reserved = await self._create(
                tenant,
                caller,
                lines,
                endpoint,
                webhook,
                deadline_s,
                metadata,
                input_file_id,
                idempotency,
            )
        if reserved is not None and idempotency is not None:
            await self._submitter.key_done(reserved, idempotency, batch.id)
        return batch, reserved is None and idempotency is not None

    async def _create(
        self,
        tenant: TenantRecord,
        caller: Caller,
        lines: list[Parsed | LineError],
        endpoint: BatchEndpoint,
        webhook: WebhookTarget | None,
        deadline_s: float | None,
        metadata: dict[str, str] | None,
        input_file_id: str | None,
        idempotency: Idempotency | None,
    ) -> tuple[BatchPublic, IdempotencyKeys | None]:
        """The admitted batch (or the earlier one of its idempotency key), and the key's
        reservation to mark done if this request made one."""
        errors = [line for line in lines if isinstance(line, LineError)]
        unique: list[Parsed] = []
        seen: set[str] = set()
        for line in (line for line in lines if isinstance(line, Parsed)):
            if line.custom_id in seen:
                errors.append(LineError(line.number, f"custom_id {line.custom_id!r} is used twice"))
                continue
            seen.add(line.custom_id)
            unique.append(line)
        names: dict[str, Resolved | ApiError] = {}
        for name in dict.fromkeys(line.submission.adapter for line in unique):
            try:
                names[name] = (await self._submitter.resolve(caller, name))[1]
            except ApiError as exc:
                if exc.code == ErrorCode.UNAUTHORIZED:
                    raise  # the key itself went (revoked meanwhile): the whole request
                names[name] = exc
        parsed, requests = [], []
        for line in unique:
            found = names[line.submission.adapter]
            if isinstance(found, ApiError):
                errors.append(LineError(line.number, found.message, found.code))
                continue
            request = line.submission
            if deadline_s is not None:
                request = dataclasses.replace(request, deadline_s=deadline_s)
            parsed.append(line)
            requests.append((request, found))
        prepared: list[Prepared] = []
        for line, ready in zip(parsed, await self._submitter.prepare_many(requests), strict=True):
            if isinstance(ready, ApiError):
                errors.append(LineError(line.number, ready.message, ready.code))
            else:
                prepared.append(ready)
        if errors:
            raise refused(sorted(errors, key=lambda e: e.line), len(lines))

        batch_id = "batch_" + uuid.uuid4().hex
        keys = None
        if idempotency is not None:
            keys, reservation = await self._submitter.reserve_key(tenant, idempotency, batch_id)
            if not reservation.owned:
                return await self._replay(tenant, reservation), None
        now = time.time()
        jobs: list[JobPublic] = []
        messages: list[JobMessage] = []
        # Routed as they are made: taken back if the batch is not admitted.
        with self._submitter.settling(messages):
            for ready in prepared:
                job_id = uuid.uuid4().hex
                job, message = self._submitter.job(tenant, ready, job_id, batch=batch_id)
                jobs.append(job)
                messages.append(message)
            record = BatchRecord(
                id=batch_id,
                tenant=tenant.name,
                endpoint=endpoint,
                input_file_id=input_file_id,
                created_at=int(now),
                expires_at=int(max(m.deadline_at for m in messages)),
                webhook=webhook,
                metadata=metadata,
            )
            reported = [
                BatchLine(
                    custom_id=line.custom_id,
                    job_id=job.id,
                    endpoint=line.endpoint,
                    model=line.model,
                )
                for line, job in zip(parsed, jobs, strict=True)
            ]
            await self._admit(tenant, record, jobs, reported, messages, keys)
        for job in jobs:
            self._submitter.metrics.admitted_job(job.tier, job.adapter)
        if self._submitter.popularity is not None:
            self._submitter.popularity.count(jobs)
        # As admitted, from memory: no read after the admission that could fail it (a 503
        # for a batch that is queued, its idempotency key left pending for a retry to
        # admit it again once the key lapsed).
        admitted = {"record": record.model_dump_json(), "total": str(len(jobs))}
        return batch_public(admitted), keys

    async def _replay(self, tenant: TenantRecord, reservation: Reservation) -> BatchPublic:
        if reservation.conflict:
            raise ApiError(
                409,
                ErrorCode.IDEMPOTENCY_CONFLICT,
                "This Idempotency-Key was used with a different request "
                f"({reservation.job_id}). Use a new key for a new batch.",
            )
        batch = await self.get(tenant, reservation.job_id)
        if batch is None:
            raise ApiError(
                409,
                ErrorCode.IDEMPOTENCY_CONFLICT,
                f"This Idempotency-Key belongs to {reservation.job_id}, which is not a batch "
                "or whose record has expired. Use a new key.",
            )
        return batch

    async def _admit(
        self,
        tenant: TenantRecord,
        record: BatchRecord,
        jobs: list[JobPublic],
        lines: list[BatchLine],
        messages: list[JobMessage],
        idempotency: IdempotencyKeys | None,
    ) -> None:
        """As ``Submitter._admit`` for one job: a refusal frees the idempotency key at once, a
        withdrawal once it is done."""
        base = self._submitter.limits(tenant, jobs[0].tier)
        limits = admission.BatchLimits(
            tenant_max=base.tenant_max,
            rate_per_s=base.rate_per_s,
            burst=base.burst,
            tier_max={tier: self._settings.tier_limit(tier) for tier in admission.TIER_ORDER},
        )
        try:
            _check_admissible(tenant.name, jobs, limits)
        except ApiError:
            await self._release(idempotency, record.id)
            raise
        expires_at = max(m.deadline_at for m in messages) + admission.LEDGER_GRACE_S
        queues = self._submitter.queues
        encoded = [job_message(message) for message in messages]

        async def admit() -> None:
            keys, args = admission.admit_batch_call(
                record,
                jobs,
                lines,
                expires_at,
                limits,
                self._settings.job_ttl_s,
                messages=encoded if queues.inline else None,
                queues=[destination(message) for message in messages],
                routed=[
                    (message.routed.worker, body) if message.routed else None
                    for message, body in zip(messages, encoded, strict=True)
                ],
            )
            reply = await self._admit_script(keys=keys, args=args)
            verdict, full = admission.batch_verdict(reply, jobs)
            if verdict.refusal is None:
                return
            await self._release(idempotency, record.id)  # also when cut short meanwhile
            tier = next((job.tier for job in jobs if job.queue == full), None)
            wanted = len(jobs) if full is None else sum(job.queue == full for job in jobs)
            raise refusal_error(
                verdict,
                admission.Limits(
                    tier_max=limits.tier_max[tier] if tier else 0,
                    tenant_max=limits.tenant_max,
                    rate_per_s=limits.rate_per_s,
                    burst=limits.burst,
                ),
                tenant.name,
                tier,
                self._settings.admission_retry_after_s,
                what=f"a batch of {wanted} jobs",
            )

        async def withdraw() -> None:
            keys, args = admission.withdraw_batch_call(record, jobs, limits.burst)
            await self._withdraw_script(keys=keys, args=args)
            if idempotency is not None:
                await idempotency.release(record.id)

        async def enqueue() -> None:
            if not queues.inline:
                await queues.push(messages, encoded)

        await admit_then_enqueue(admit, enqueue, withdraw)

    @staticmethod
    async def _release(idempotency: IdempotencyKeys | None, batch_id: str) -> None:
        if idempotency is not None:
            with contextlib.suppress(RedisError, OSError):
                await idempotency.release(batch_id)

    async def get(self, tenant: TenantRecord, batch_id: str) -> BatchPublic | None:
        fields: dict[str, str] = await self._redis.hgetall(batch_key(batch_id))  # type: ignore[assignment]
        if not fields or fields.get("tenant") != tenant.name:
            return None
        batch = batch_public(fields)
        if batch.webhook is not None and batch.status in ("completed", "cancelled"):
            delivery = await delivery_status(self._redis, batch_event_id(batch_id))
            batch = batch.model_copy(update={"webhook_delivery": delivery})
        return batch

    async def lines(
        self, batch_id: str, with_results: bool = False
    ) -> AsyncIterator[list[tuple[BatchLine, JobPublic | None]]]:
        """The batch's lines in submission order, with their jobs, a chunk at a time;
        ``with_results``: results kept in the object store read back (``ApiError`` if one
        cannot be), otherwise those jobs' ``result`` is ``None``."""
        start = 0
        while True:
            raw = await self._redis.lrange(batch_jobs_key(batch_id), start, start + READ_CHUNK - 1)
            if not raw:
                return
            lines = [BatchLine.model_validate_json(item) for item in raw]
            async with self._redis.pipeline(transaction=False) as pipe:
                for line in lines:
                    pipe.hmget(job_key(line.job_id), RECORD_FIELDS)
                records = await pipe.execute()
            jobs = [job_of(rec) for rec in records]
            if with_results:
                jobs = await self._with_results(jobs)
            yield list(zip(lines, jobs, strict=True))
            start += READ_CHUNK

    async def _with_results(self, jobs: list[JobPublic | None]) -> list[JobPublic | None]:
        """``jobs`` with the results kept in the object store read back, a few at a time
        (one request must not take every read thread); the first failure cancels the reads
        not yet started and is raised."""
        gate = asyncio.Semaphore(READS_PER_REQUEST)

        async def read(job: JobPublic) -> JobPublic:
            async with gate:
                return await self._results.read(job)

        reads = {
            index: asyncio.ensure_future(read(job))
            for index, job in enumerate(jobs)
            if job is not None and stored_result(job) is not None
        }
        if not reads:
            return jobs
        try:
            done, _ = await asyncio.wait(reads.values(), return_when=asyncio.FIRST_EXCEPTION)
            failures = [task.exception() for task in done if not task.cancelled()]
            for failure in failures:
                if failure is not None:
                    raise failure
        finally:
            for task in reads.values():
                task.cancel()
        out = list(jobs)
        for index, task in reads.items():
            out[index] = task.result()
        return out

    async def cancel(self, tenant: TenantRecord, batch_id: str) -> BatchPublic | None:
        """Cancel every job of the batch that has not started; running ones finish."""
        if await self.get(tenant, batch_id) is None:
            return None
        # A batch whose jobs have all ended stays as it ended (completed, its webhook sent):
        # a late cancel must not turn it into "cancelled".
        requested = await self._request_cancel(keys=[batch_key(batch_id)], args=[repr(time.time())])
        if not requested:
            return await self.get(tenant, batch_id)
        async for chunk in self.lines(batch_id):
            for line, job in chunk:
                if job is not None and job.status == JobStatus.QUEUED:
                    ttl_s = self._settings.job_ttl_s
                    cancelled, wrote = await job_store.cancel_job(
                        self._redis, line.job_id, tenant.name, ttl_s, only_queued=True
                    )
                    if wrote and cancelled is not None:
                        self._submitter.metrics.job_cancelled(cancelled.tier)
        return await self.get(tenant, batch_id)
