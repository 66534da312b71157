"""Admission: the one path every job takes into the fleet, whatever API it came through.

resolve the adapter (granted to the tenant?) -> check the deadline and the prompt's length
-> reserve the idempotency key -> admit against the limits and enqueue (ledger, record and
queue message in one script, when the queues share the job store's Redis) -> on any
failure, undo everything. A caller sees 202 only for an enqueued job and never leaves
anything behind on a refusal.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import math
import time
import uuid
from collections.abc import AsyncIterator, Awaitable, Callable, Coroutine, Iterator
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from datetime import UTC, datetime
from typing import Any

import sentry_sdk
from redis.asyncio import Redis
from redis.exceptions import RedisError

from contracts import admission
from contracts.errors import ErrorCode
from contracts.jobs import MAX_PROMPT_CHARS, JobMessage, JobPublic, JobStatus, Sampling
from contracts.queues import Tier, queue_for
from contracts.tenants import TenantRecord
from contracts.webhooks import WebhookTarget
from gateway import job_store
from gateway.access import Access, Caller, Unconfirmed, check
from gateway.config import GatewaySettings
from gateway.errors import ADMISSION_TIMED_OUT, ApiError, unavailable
from gateway.idempotency import IdempotencyKeys, Reservation
from gateway.metrics import GatewayMetrics
from gateway.models import BaseModels, ChatTemplateError, ServedModel
from gateway.popularity import PopularityCounter
from gateway.queue import JobQueues, job_message
from gateway.registry import Resolved
from gateway.routing import FleetRouter, destination
from gateway.webhooks import check_target

log = logging.getLogger(__name__)

INLINE_PROMPT_CHARS = 1024
"""Requests this small (prompt, or chat messages' text) are rendered and counted on the
event loop (tens of microseconds); larger ones in the prompt threads (tokenizing holds the
GIL for about a second a megabyte)."""


PREPARE_CHUNK = 256
"""Batch lines checked per trip to the prompt threads."""


def _size(request: Submission) -> int:
    if request.messages is None:
        return len(request.prompt or "")
    return sum(
        len(str(message.get("content") or "")) + len(str(message.get("name") or ""))
        for message in request.messages
    )


@dataclass(frozen=True)
class Submission:
    """One job as a caller asked for it: a prompt, or chat messages to render into one."""

    adapter: str
    sampling: Sampling
    prompt: str | None = None
    messages: list[dict[str, Any]] | None = None
    deadline_s: float | None = None
    stream: bool = False
    webhook: WebhookTarget | None = None
    adapter_field: str = "adapter"
    """The request field that names the adapter (``model`` on the OpenAI endpoints): what a
    refusal of the name points at."""


@dataclass(frozen=True)
class Prepared:
    """A request checked and ready to admit."""

    request: Submission
    resolved: Resolved
    deadline_s: float
    prompt: str
    add_special_tokens: bool


@dataclass(frozen=True)
class Admitted:
    job: JobPublic
    replayed: bool
    """True when an ``Idempotency-Key`` matched an earlier request: nothing new was enqueued."""


@dataclass(frozen=True)
class Idempotency:
    key: str
    fingerprint: str


class Submitter:
    def __init__(
        self,
        redis: Redis,
        queues: JobQueues,
        models: BaseModels,
        metrics: GatewayMetrics,
        settings: GatewaySettings,
        router: FleetRouter | None = None,
        popularity: PopularityCounter | None = None,
    ) -> None:
        self._redis = redis
        self.popularity = popularity
        self.queues = queues
        self._router = router
        self._admit_script = redis.register_script(admission.ADMIT)
        self._withdraw_script = redis.register_script(admission.WITHDRAW)
        self._models = models
        self.metrics = metrics
        self._settings = settings
        self._prompts = ThreadPoolExecutor(settings.prompt_threads, thread_name_prefix="prompts")

    async def submit(
        self,
        access: Access,
        request: Submission,
        idempotency: Idempotency | None = None,
        job_id: str | None = None,
        reply_to: str | None = None,
    ) -> Admitted:
        """Admit and enqueue ``request`` for the caller ``access`` authenticated (and resolved
        ``request.adapter`` for), or raise ``ApiError``. ``job_id``: the id the new job takes
        (a caller that watches for the job's end before it exists mints it); a replay under
        an idempotency key answers the earlier job instead. ``reply_to``: the channel the new
        job's final record is published on (``JobWaiter.replies``, where its caller waits).

        Redis and the broker get ``request_timeout_s`` in all: past it the answer is 503.
        """
        job_id = job_id or uuid.uuid4().hex
        async with self.bounded(self._settings.request_timeout_s):
            if access.name != request.adapter:
                raise RuntimeError(f"access resolved {access.name!r}, not {request.adapter!r}")
            unconfirmed = access.unconfirmed

            async def submit_on(
                on: Access, recalled: Unconfirmed | None
            ) -> tuple[Admitted, IdempotencyKeys | None]:
                resolved = on.admissible(request.adapter_field)
                return await self._submit(
                    on.tenant, resolved, request, idempotency, job_id, reply_to, recalled
                )

            try:
                admitted, reserved = await submit_on(access, unconfirmed)
            except (ApiError, admission.AccessChanged) as error:
                if unconfirmed is None or unconfirmed.confirmed:
                    raise
                # The admission found the recalled access changed (nothing written), or the
                # request was refused before its admission checked it (a prompt too long for
                # the recalled adapter's model, say) and must be refused as a read would refuse
                # it. Either way the access is read: its own refusal (401, 404, 410) comes
                # first; a refusal stands if the access did not change; else the submission
                # runs again on what was read.
                fresh = await unconfirmed.reread()
                if isinstance(error, ApiError) and fresh == access:
                    raise error from None
                admitted, reserved = await submit_on(fresh, None)
        if not admitted.replayed:
            self.metrics.admitted_job(admitted.job.tier, admitted.job.adapter)
            if self.popularity is not None:
                self.popularity.count([admitted.job])
        if reserved is not None and idempotency is not None:
            await self.key_done(reserved, idempotency, admitted.job.id)
        return admitted

    async def reserve_key(
        self, tenant: TenantRecord, idempotency: Idempotency, admits: str
    ) -> tuple[IdempotencyKeys, Reservation]:
        """Reserve ``idempotency``'s key for the job or batch ``admits`` (see
        ``IdempotencyKeys.reserve``)."""
        keys = IdempotencyKeys(
            self._redis, tenant.name, idempotency.key, self._settings.idempotency_ttl_s
        )
        return keys, await keys.reserve(idempotency.fingerprint, admits)

    async def key_done(
        self, reserved: IdempotencyKeys, idempotency: Idempotency, admitted: str
    ) -> None:
        """Mark the key done for ``admitted`` (a job or batch id), which is enqueued: the
        answer is 202 even if the key can't be marked (it then expires as pending instead of
        being remembered for the full TTL)."""
        try:
            async with asyncio.timeout(self._settings.redis_timeout_s):
                await reserved.done(idempotency.fingerprint, admitted)
        except (RedisError, OSError, TimeoutError) as exc:
            log.warning("idempotency key of %s not marked done: %s", admitted, exc)

    @contextlib.asynccontextmanager
    async def bounded(self, timeout_s: float) -> AsyncIterator[None]:
        """Admission work within ``timeout_s``: a refusal (``ApiError``) is counted and
        raised, but not a 401 (a key that does not hold is refused before admission, as the
        key check refuses it, uncounted here); Redis or the broker failing, or the time
        running out, is a counted 503."""
        try:
            async with asyncio.timeout(timeout_s):
                yield
        except ApiError as refused:
            if refused.code != ErrorCode.UNAUTHORIZED:
                self.metrics.refused.labels(refused.code.value).inc()
            raise
        except (RedisError, OSError, TimeoutError, admission.AdmissionWithdrawn) as exc:
            # Also a Redis that refuses the write (full: maxmemory with noeviction).
            error = unavailable(ADMISSION_TIMED_OUT, exc)
            self.metrics.refused.labels(error.code.value).inc()
            raise error from exc

    async def _submit(
        self,
        tenant: TenantRecord,
        resolved: Resolved,
        request: Submission,
        idempotency: Idempotency | None,
        job_id: str,
        reply_to: str | None,
        unconfirmed: Unconfirmed | None = None,
    ) -> tuple[Admitted, IdempotencyKeys | None]:
        """The admitted job, and the idempotency reservation to mark done if this request
        made one. ``unconfirmed``: the caller's access was recalled: the admission checks it
        (``AccessChanged`` if it changed: nothing written, the reservation released)."""
        prepared = await self.prepare(request, resolved)
        sentry_sdk.set_tags(
            {"adapter": prepared.resolved.record.alias, "revision": prepared.resolved.record.digest}
        )
        if request.webhook is not None:
            await check_target(request.webhook, self._settings)

        keys = None
        if idempotency is not None:
            keys, reservation = await self.reserve_key(tenant, idempotency, job_id)
            if not reservation.owned:
                if unconfirmed is not None and not unconfirmed.confirmed:
                    # An earlier request's job, answered to an access no admission checked:
                    # read first, and refused as a fresh read would refuse it (401, 404, 410).
                    fresh = await unconfirmed.reread()
                    fresh.admissible(request.adapter_field)
                    tenant = fresh.tenant
                return await self._replay(tenant, reservation), None
        job, message = self.job(tenant, prepared, job_id)
        # A refusal frees the key at once, a withdrawal once it is done (``_admit``); while
        # the admission's fate is unknown a retry waits for the reservation to lapse rather
        # than admit the job a second time.
        with self.settling([message]):
            await self._admit(tenant, job, message, keys, reply_to, unconfirmed)
        return Admitted(job=job, replayed=False), keys

    @contextlib.contextmanager
    def settling(self, messages: list[JobMessage]) -> Iterator[None]:
        """Settle the routes of ``messages`` (``job`` chose them; the list may grow inside the
        block) with their admission: admitted if the block completes; refused if it raises
        ``ApiError`` or ``AccessChanged`` (``NOTHING_WRITTEN``); else of unknown fate (a lost
        reply, the caller gone), withdrawn in the background."""
        router = self._router
        if router is None:
            yield
            return
        try:
            yield
        except BaseException as exc:
            refused = isinstance(exc, NOTHING_WRITTEN)
            for m in messages:
                router.settle(m.job_id, m.tier, m.routed, admitted=False, refused=refused)
            raise
        for m in messages:
            router.settle(m.job_id, m.tier, m.routed, admitted=True, refused=False)

    async def prepare(self, request: Submission, resolved: Resolved) -> Prepared:
        """Everything decided before admission, for a request whose adapter ``resolve``d:
        the deadline, the prompt and its length. Raises ``ApiError``."""
        deadline_s = self._deadline_s(request)
        model = await self._models.get(resolved.record.base_model.digest)
        if _size(request) <= INLINE_PROMPT_CHARS:
            prompt, add_special_tokens = self._checked_prompt(request, model, resolved)
        else:
            # Rendering and tokenizing cost CPU in proportion to the prompt: in the bounded
            # pool, so a huge request delays only itself, never the event loop.
            prompt, add_special_tokens = await asyncio.get_running_loop().run_in_executor(
                self._prompts, self._checked_prompt, request, model, resolved
            )
        return Prepared(request, resolved, deadline_s, prompt, add_special_tokens)

    async def prepare_many(
        self, requests: list[tuple[Submission, Resolved]]
    ) -> list[Prepared | ApiError]:
        """``prepare`` for each of many requests (a batch), each refusal in its place; the
        checks run in the prompt threads a chunk at a time, never stalling the event loop."""
        models = {
            digest: await self._models.get(digest)
            for digest in {resolved.record.base_model.digest for _, resolved in requests}
        }

        def chunk(part: list[tuple[Submission, Resolved]]) -> list[Prepared | ApiError]:
            done: list[Prepared | ApiError] = []
            for request, resolved in part:
                try:
                    model = models[resolved.record.base_model.digest]
                    prompt, special = self._checked_prompt(request, model, resolved)
                    done.append(
                        Prepared(request, resolved, self._deadline_s(request), prompt, special)
                    )
                except ApiError as refused:
                    done.append(refused)
            return done

        loop = asyncio.get_running_loop()
        prepared: list[Prepared | ApiError] = []
        for start in range(0, len(requests), PREPARE_CHUNK):
            part = requests[start : start + PREPARE_CHUNK]
            prepared += await loop.run_in_executor(self._prompts, chunk, part)
        return prepared

    def _checked_prompt(
        self, request: Submission, model: ServedModel | None, resolved: Resolved
    ) -> tuple[str, bool]:
        prompt, add_special_tokens = self._prompt(request, model, resolved)
        self._check_length(prompt, add_special_tokens, request.sampling, model)
        return prompt, add_special_tokens

    def close(self) -> None:
        """Stop the prompt threads (at shutdown; a running render finishes on its own)."""
        self._prompts.shutdown(wait=False, cancel_futures=True)

    async def resolve(self, caller: Caller, name: str) -> tuple[TenantRecord, Resolved]:
        """The caller's tenant and the revision ``name`` resolves to for it (one round trip),
        or the ``ApiError`` refusing it (``Access.admissible``; 401 for the key)."""
        access = await check(self._redis, caller, name)
        return access.tenant, access.admissible()

    def _deadline_s(self, request: Submission) -> float:
        limit = self._settings.job_deadline_s
        if request.deadline_s is not None and request.deadline_s > limit:
            raise ApiError(
                422,
                ErrorCode.VALIDATION_ERROR,
                f"Invalid request: deadline_s: at most {limit:g} seconds.",
                param="deadline_s",
            )
        return request.deadline_s or limit

    @staticmethod
    def _prompt(
        request: Submission, model: ServedModel | None, resolved: Resolved
    ) -> tuple[str, bool]:
        """The prompt text, and whether the engine adds special tokens (not to a rendered
        chat template, which carries its own)."""
        if request.messages is None:
            assert request.prompt is not None
            return request.prompt, True
        base = resolved.record.base_model
        if model is None:
            raise ApiError(
                503,
                ErrorCode.SERVICE_UNAVAILABLE,
                f"No worker has described base model {base.id} yet, so its chat template is "
                "unknown. Nothing was enqueued; retry once a worker for it is up.",
                headers={"Retry-After": "10"},
            )
        try:
            rendered = model.render_chat(request.messages)
        except ChatTemplateError as exc:
            raise ApiError(
                422,
                ErrorCode.VALIDATION_ERROR,
                f"Invalid request: messages: the model's chat template refused them ({exc}).",
                param="messages",
            ) from exc
        if rendered is None:
            raise ApiError(
                422,
                ErrorCode.VALIDATION_ERROR,
                f"Invalid request: base model {base.id} has no chat template; use "
                "/v1/completions with a prompt.",
                param="messages",
            )
        if len(rendered) > MAX_PROMPT_CHARS:
            raise ApiError(
                422,
                ErrorCode.PROMPT_TOO_LONG,
                f"The chat renders to {len(rendered)} characters; at most {MAX_PROMPT_CHARS} "
                "are accepted, as for a prompt. Nothing was enqueued.",
                param="messages",
            )
        return rendered, False

    @staticmethod
    def _check_length(
        prompt: str, add_special_tokens: bool, sampling: Sampling, model: ServedModel | None
    ) -> None:
        """Refuse a prompt that can't fit the context: first by its length alone (so a huge
        prompt is never tokenized), then by its tokens."""
        if model is None:
            return  # no worker has served this base yet: the worker checks instead
        context = model.card.max_model_len
        fewest = model.fewest_tokens(prompt)
        if fewest is None:
            return
        if fewest + sampling.max_tokens > context:
            raise _too_long(f"at least {fewest}", sampling.max_tokens, context)
        tokens = model.count_tokens(prompt, add_special_tokens)
        if tokens is not None and tokens + sampling.max_tokens > context:
            raise _too_long(str(tokens), sampling.max_tokens, context)

    def job(
        self, tenant: TenantRecord, prepared: Prepared, job_id: str, batch: str | None = None
    ) -> tuple[JobPublic, JobMessage]:
        """The record and the queue message of a prepared request, deadline counted from now."""
        record, request = prepared.resolved.record, prepared.request
        accepted_at = time.time()
        deadline_at = accepted_at + prepared.deadline_s
        job = JobPublic(
            id=job_id,
            status=JobStatus.QUEUED,
            tenant=tenant.name,
            adapter=record.alias,
            channel=prepared.resolved.channel,
            revision=record.digest,
            tier=record.tier,
            queue=queue_for(record.tier, record.base_model.digest),
            created_at=datetime.fromtimestamp(accepted_at, tz=UTC),
            deadline_at=datetime.fromtimestamp(deadline_at, tz=UTC),
            batch=batch,
            webhook=request.webhook,
        )
        message = JobMessage(
            job_id=job_id,
            tenant=tenant.name,
            adapter=record.alias,
            revision=record.digest,
            base_model=record.base_model,
            tier=record.tier,
            prompt=prepared.prompt,
            add_special_tokens=prepared.add_special_tokens,
            stream=request.stream,
            sampling=request.sampling,
            accepted_at=accepted_at,
            deadline_at=deadline_at,
        )
        if self._router is not None:  # last: once routed, nothing here raises
            routed = self._router.route(
                job_id, record.base_model.digest, record.tier, record.digest
            )
            message = message.model_copy(update={"routed": routed})
        return job, message

    def limits(self, tenant: TenantRecord, tier: Tier) -> admission.Limits:
        own, defaults = tenant.limits, self._settings
        return admission.Limits(
            tier_max=defaults.tier_limit(tier),
            tenant_max=own.max_concurrent or defaults.tenant_max_concurrent,
            rate_per_s=own.rate_per_s or defaults.tenant_rate_per_s,
            burst=own.burst or defaults.tenant_burst,
        )

    async def _admit(
        self,
        tenant: TenantRecord,
        job: JobPublic,
        message: JobMessage,
        idempotency: IdempotencyKeys | None,
        reply_to: str | None,
        unconfirmed: Unconfirmed | None = None,
    ) -> None:
        """Ledger, record and queue message in one script (a broker of its own gets the
        message next: a failed push withdraws the admission, and so does a lost reply; the
        idempotency reservation is released once the withdrawal is done). ``unconfirmed``:
        the script checks the recalled access first (``AccessChanged``: nothing written, the
        reservation released)."""
        limits = self.limits(tenant, job.tier)
        expires_at = message.deadline_at + admission.LEDGER_GRACE_S
        encoded = job_message(message)

        async def admit() -> None:
            keys, args = admission.admit_call(
                job,
                expires_at,
                limits,
                self._settings.job_ttl_s,
                message=encoded if self.queues.inline else None,
                queue=destination(message),
                routed=(message.routed.worker, encoded) if message.routed else None,
                stream=message.stream,
                reply_to=reply_to,
                recalled=None if unconfirmed is None else unconfirmed.recalled,
            )
            try:
                verdict = admission.verdict(await self._admit_script(keys=keys, args=args))
            except admission.AccessChanged:
                self.metrics.access_recalls.labels("changed").inc()
                if idempotency is not None:
                    with contextlib.suppress(RedisError, OSError):
                        await idempotency.release(job.id)
                raise
            if unconfirmed is not None:  # the script read the key and found it unchanged
                unconfirmed.confirmed = True
                self.metrics.access_recalls.labels("held").inc()
            if verdict.refusal is not None:
                if idempotency is not None:  # also when its request was cut short meanwhile
                    with contextlib.suppress(RedisError, OSError):
                        await idempotency.release(job.id)
                raise refusal_error(
                    verdict, limits, job.tenant, job.tier, self._settings.admission_retry_after_s
                )

        async def withdraw() -> None:
            keys, args = admission.withdraw_call(job, limits.burst)
            await self._withdraw_script(keys=keys, args=args)
            if idempotency is not None:
                await idempotency.release(job.id)

        async def enqueue() -> None:
            if not self.queues.inline:
                await self.queues.push([message], [encoded])

        await admit_then_enqueue(admit, enqueue, withdraw)

    async def _replay(self, tenant: TenantRecord, reservation: Reservation) -> Admitted:
        if reservation.conflict:
            raise ApiError(
                409,
                ErrorCode.IDEMPOTENCY_CONFLICT,
                "This Idempotency-Key was used with a different request body "
                f"(job {reservation.job_id}). Use a new key for a new request.",
            )
        job = await job_store.get_job(self._redis, reservation.job_id, tenant.name)
        if job is None:
            raise ApiError(
                409,
                ErrorCode.IDEMPOTENCY_CONFLICT,
                f"This Idempotency-Key belongs to job {reservation.job_id}, whose record has "
                "expired. Use a new key.",
            )
        return Admitted(job=job, replayed=True)


def _too_long(tokens: str, max_tokens: int, context: int) -> ApiError:
    return ApiError(
        422,
        ErrorCode.PROMPT_TOO_LONG,
        f"The prompt is {tokens} tokens; with max_tokens {max_tokens} that is more than the "
        f"model's context of {context} tokens. Shorten the prompt or lower max_tokens. "
        "Nothing was enqueued.",
        param="prompt",
    )


NOTHING_WRITTEN = (ApiError, admission.AccessChanged)
"""What an admission script raises when it wrote nothing: a refusal, or a recalled access
that changed."""

UNDO_WAIT_S = 30.0
"""How long an admission cut short may take to finish before it is withdrawn regardless."""

_undoing: set[asyncio.Task[None]] = set()  # strong references until each undo is done


async def admit_then_enqueue(
    admit: Callable[[], Awaitable[None]],
    enqueue: Callable[[], Awaitable[object]],
    withdraw: Callable[[], Awaitable[None]],
) -> None:
    """Admit (the script that writes records and ledger entries, and pushes the messages when
    the queues share its Redis), then publish to a broker of its own, as one unit: both
    happen, or neither is left behind.

    ``admit`` raises ``ApiError`` for a refusal, ``AccessChanged`` for a recalled access that
    changed (nothing written either way). A failed publish withdraws
    the admission. If the caller is cancelled midway (its request bound ran out, its client
    went away) while the admission runs, the admission goes on out of the caller's way and is
    then withdrawn: a script that ran in Redis while its reply was still on the way must not
    leave a record ``queued`` and ledger slots held behind a 503; so must one whose reply was
    lost to a timeout or a dropped connection. Cancelled while publishing, the publish is
    abandoned and the admission withdrawn at once. A message published before
    the withdrawal finds no record and is dropped by the worker; an undo that cannot reach
    Redis leaves the record to the deadline sweeper and the ledger entry to its expiry.
    """
    admitted = asyncio.ensure_future(admit())
    try:
        await asyncio.shield(admitted)
    except asyncio.CancelledError:
        _in_background(_undo_after(admitted, withdraw))
        raise
    except NOTHING_WRITTEN:
        raise  # refused: nothing was written
    except BaseException:
        # Its reply lost (a timeout, a dropped connection): the script may have run.
        _in_background(_undo_after(None, withdraw))
        raise
    try:
        await enqueue()
    except asyncio.CancelledError:
        _in_background(_undo_after(None, withdraw))
        raise
    except BaseException:
        with contextlib.suppress(RedisError, OSError):
            await withdraw()
        raise


def _in_background(undo: Coroutine[Any, Any, None]) -> None:
    task = asyncio.get_running_loop().create_task(undo)
    _undoing.add(task)
    task.add_done_callback(_undoing.discard)


async def _undo_after(
    admitting: asyncio.Future[None] | None, withdraw: Callable[[], Awaitable[None]]
) -> None:
    """Withdraw an admission once its script answered (``admitting``; ``None``: it did)."""
    if admitting is not None:
        with contextlib.suppress(BaseException):
            async with asyncio.timeout(UNDO_WAIT_S):
                await admitting
        refused = (
            admitting.done()
            and not admitting.cancelled()
            and isinstance(admitting.exception(), NOTHING_WRITTEN)
        )
        if refused:
            return  # nothing was admitted
    try:
        async with asyncio.timeout(UNDO_WAIT_S):
            await withdraw()
    except (RedisError, OSError, TimeoutError) as exc:
        log.warning("could not withdraw an admission cut short: %s", exc)
    else:
        log.info("withdrew an admission its request gave up on")


def refusal_error(
    verdict: admission.Verdict,
    limits: admission.Limits,
    tenant: str,
    tier: Tier | None,
    retry_after_s: int,
    what: str = "the job",
) -> ApiError:
    """The 429 of a refused admission, naming the limit that refused it."""
    refusal = verdict.refusal
    assert refusal is not None
    if refusal == admission.Refusal.RATE:
        retry = max(1, math.ceil(verdict.retry_after_s))
        why = f"tenant {tenant!r} is over its rate of {limits.rate_per_s:g} jobs/s"
    elif refusal == admission.Refusal.TENANT:
        retry = retry_after_s
        why = f"tenant {tenant!r} may hold {limits.tenant_max} unfinished jobs"
    else:
        retry = retry_after_s
        tier_name = tier.value if tier is not None else "its"
        why = (
            f"the {tier_name} tier of its base model's pool may hold {limits.tier_max} "
            "unfinished jobs"
        )
    return ApiError(
        429,
        admission.REFUSAL_CODES[refusal],
        f"{what[0].upper()}{what[1:]} was not accepted: {why}. Nothing was enqueued; "
        f"retry after {retry} s.",
        headers={"Retry-After": str(retry)},
    )
