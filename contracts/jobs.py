"""Job and result schemas: what callers send, what travels on the queue, what comes back."""

from __future__ import annotations

from datetime import datetime
from enum import StrEnum
from typing import Literal

from pydantic import BaseModel, ConfigDict, Field, field_validator, model_validator

from contracts.errors import ErrorBody
from contracts.queues import Tier
from contracts.registry import SLUG_PATTERN, BaseModelRef
from contracts.webhooks import WebhookStatus, WebhookTarget

MAX_PROMPT_CHARS = 100_000
MAX_STOP_SEQUENCES = 8


class Sampling(BaseModel):
    """Decoding parameters, as vLLM's ``SamplingParams`` takes them (the defaults are its
    neutral values). ``temperature == 0`` is greedy and therefore reproducible. Types are
    strict: ``"8"`` or ``true`` is not a number."""

    model_config = ConfigDict(extra="forbid", strict=True)

    max_tokens: int = Field(default=64, ge=1, le=4096)
    min_tokens: int = Field(
        default=0, ge=0, le=4096, description="tokens generated before EOS or a stop may end it"
    )
    temperature: float = Field(default=0.0, ge=0.0, le=2.0)
    top_p: float = Field(default=1.0, gt=0.0, le=1.0)
    top_k: int = Field(default=0, ge=-1, le=1_000_000, description="0 or -1: every token")
    min_p: float = Field(default=0.0, ge=0.0, le=1.0)
    presence_penalty: float = Field(default=0.0, ge=-2.0, le=2.0)
    frequency_penalty: float = Field(default=0.0, ge=-2.0, le=2.0)
    repetition_penalty: float = Field(default=1.0, gt=0.0, le=2.0)
    seed: int | None = Field(default=None, ge=0, le=2**63 - 1)
    stop: list[str] = Field(default_factory=list, max_length=MAX_STOP_SEQUENCES)
    ignore_eos: bool = False

    @field_validator("stop")
    @classmethod
    def _stops_not_empty(cls, value: list[str]) -> list[str]:
        if any(not stop for stop in value):
            raise ValueError("stop sequences must be non-empty strings")
        return value

    @model_validator(mode="after")
    def _min_within_max(self) -> Sampling:
        if self.min_tokens > self.max_tokens:
            raise ValueError(f"min_tokens ({self.min_tokens}) exceeds max_tokens")
        return self


class JobCreate(BaseModel):
    """Body of ``POST /v1/jobs``."""

    model_config = ConfigDict(extra="forbid", strict=True)

    adapter: str = Field(
        pattern=SLUG_PATTERN,
        description="alias of a published adapter, or a channel pointing to one",
    )
    prompt: str = Field(min_length=1, max_length=MAX_PROMPT_CHARS)
    sampling: Sampling = Field(default_factory=Sampling)
    deadline_s: float | None = Field(
        default=None,
        gt=0,
        description="seconds from admission until the job fails with deadline_exceeded; "
        "at most the fleet's limit, which is also the default",
    )
    webhook: WebhookTarget | None = Field(
        default=None, description="POST the job here, signed, once it reaches a terminal state"
    )


RoutedAs = Literal["resident", "placed", "shared"]


class Routed(BaseModel):
    """The gateway's routing decision for a job (``contracts.routing``)."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    decision: RoutedAs
    worker: str = Field(description="the worker (`host:pid:boot`) whose own queue it went to")


class JobMessage(BaseModel):
    """What the gateway puts on a pool queue (or a worker's own): the revision is fixed at
    admission."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    job_id: str
    tenant: str
    adapter: str
    revision: str
    base_model: BaseModelRef
    tier: Tier
    prompt: str
    add_special_tokens: bool = Field(
        default=True, description="false when the prompt is a rendered chat template"
    )
    stream: bool = Field(default=False, description="publish text deltas as they are produced")
    sampling: Sampling
    accepted_at: float = Field(description="gateway clock, unix seconds")
    deadline_at: float = Field(description="gateway clock, unix seconds")
    routed: Routed | None = Field(
        default=None,
        description="set when the job went to a worker's own queue; absent: the shared queue",
    )

    def wire(self) -> dict[str, object]:
        """The message as it is published. Fields added after the first release are written
        only when they are not neutral: during a rolling deploy a worker that predates them
        (it forbids unknown fields) still runs every job that does not use them (and no job
        is routed to a worker that does not announce a queue of its own)."""
        data = self.model_dump(mode="json")
        if data["routed"] is None:
            del data["routed"]
        sampling = data["sampling"]
        for name in ADDED_SAMPLING:
            if sampling[name] == Sampling.model_fields[name].default:
                del sampling[name]
        return data


ADDED_SAMPLING = (
    "min_tokens",
    "top_k",
    "min_p",
    "presence_penalty",
    "frequency_penalty",
    "repetition_penalty",
)
"""``Sampling`` fields that workers of the first release do not know."""


class JobStatus(StrEnum):
    QUEUED = "queued"
    RUNNING = "running"
    SUCCEEDED = "succeeded"
    FAILED = "failed"
    CANCELLED = "cancelled"

    @property
    def terminal(self) -> bool:
        return self in TERMINAL_STATUSES


TERMINAL_STATUSES = frozenset({JobStatus.SUCCEEDED, JobStatus.FAILED, JobStatus.CANCELLED})


Residency = Literal["gpu", "cpu", "disk", "remote", "unknown"]


class LoadTimings(BaseModel):
    """Milliseconds spent in each loading phase for this job; ``None`` where it did not run."""

    fetch: float | None = None
    verify: float | None = None
    engine_load: float | None = None


class EngineInfo(BaseModel):
    name: str
    version: str


class Usage(BaseModel):
    prompt_tokens: int
    completion_tokens: int
    total_tokens: int


class StoredResult(BaseModel):
    """Where a result too large for the job store is kept: an object in the object store,
    named by the sha256 of its bytes, under its tenant (``contracts.storage.result_key``)."""

    key: str
    sha256: str = Field(description="hex digest of the object's bytes; checked on every read")
    size_bytes: int = Field(ge=0)
    finish_reason: str | None = Field(
        description="the result's, kept here too: a stream's last chunk needs no read"
    )
    usage: Usage = Field(description="the result's, kept here too")


class ResultMetadata(BaseModel):
    """Observed facts about how a job ran (never inferred from timing)."""

    adapter: str
    revision: str = Field(description="registry digest resolved at admission")
    loaded_digest: str | None = Field(description="digest of the files handed to the engine")
    identity_verified: bool
    base_model: BaseModelRef
    residency_before: Residency
    prefetched: bool = Field(
        default=False,
        description="the level `residency_before` names (`disk`, `cpu`) was reached by a "
        "prefetch (queue look-ahead, popularity, warm-up), not by a job",
    )
    load_ms: LoadTimings
    queue_wait_ms: float
    slot_wait_ms: float | None = Field(
        default=None,
        description="how long the job waited on its worker for a GPU adapter slot (one of "
        "`max_loras`, taken by requests of other adapters; ~0 for a pinned adapter, which holds "
        "its own), also when its deadline or a cancellation ended the wait; none where it never "
        "asked for one",
    )
    to_engine_ms: float | None = Field(
        default=None,
        description="from the worker's start of the job to its request's arrival in the "
        "engine (the moment `ttft_ms` counts from): staging and loading its adapter "
        "(`load_ms`), the slot wait, the hand-over to the engine; none where it never got there",
    )
    ttft_ms: float | None
    e2e_ms: float
    worker: str
    engine: EngineInfo
    routed: RoutedAs = Field(
        default="shared",
        description="where the gateway sent it: `resident` (the own queue of a worker holding "
        "its adapter), `placed` (of the worker chosen to hold it), `shared` (its pool queue)",
    )
    routed_to: str | None = Field(
        default=None,
        description="the worker it was routed to (`host:pid:boot`); when that is not the "
        "worker that ran it, the job was handed back to the shared queue",
    )
    result_stored: StoredResult | None = Field(
        default=None,
        description="set when the result was larger than `LORAFLEET_RESULT_OFFLOAD_BYTES`: it "
        "is kept in the object store (S3) under this key, not in Redis, and read back from "
        "there for every answer (`result` is always given)",
    )


class JobResult(BaseModel):
    text: str
    token_ids: list[int]
    finish_reason: str | None
    usage: Usage


class JobAccepted(BaseModel):
    """Body of the 202 answer to ``POST /v1/jobs``."""

    id: str
    status: JobStatus
    adapter: str
    channel: str | None = None
    revision: str
    queue: str


class JobPublic(BaseModel):
    """A job as callers see it (``GET /v1/jobs/{id}``)."""

    id: str
    status: JobStatus
    tenant: str
    adapter: str
    channel: str | None = Field(default=None, description="channel the caller named, if any")
    revision: str
    tier: Tier
    queue: str
    created_at: datetime
    deadline_at: datetime | None = None
    started_at: datetime | None = None
    finished_at: datetime | None = None
    attempts: int = Field(
        default=0, description="deliveries that started running it (more than one after a crash)"
    )
    engine_failures: int = Field(
        default=0,
        description="times the engine running it died while it was generating; it was handed "
        "back to its queue each time, the attempt uncounted",
    )
    worker: str | None = Field(
        default=None, description="worker (`host:pid:boot`) running or last running it"
    )
    batch: str | None = Field(default=None, description="the batch it belongs to, if any")
    webhook: WebhookTarget | None = None
    webhook_delivery: WebhookStatus | None = Field(
        default=None, description="how the webhook call is going (once the job has finished)"
    )
    result: JobResult | None = None
    error: ErrorBody | None = None
    metadata: ResultMetadata | None = None
