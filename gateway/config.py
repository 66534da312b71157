"""Gateway settings: one object per process, read from the environment once."""

from __future__ import annotations

from functools import lru_cache

from pydantic import Field

from contracts.queues import Tier
from contracts.settings import ServiceSettings


class GatewaySettings(ServiceSettings):
    """Every knob of the gateway. Env var = ``LORAFLEET_`` + field name, upper case."""

    redis_timeout_s: float = Field(
        default=2.0,
        gt=0,
        description="Bound on one Redis command (reply, connection, a free pooled connection): "
        "a Redis that does not answer makes the request 503 with `Retry-After`, and nothing is "
        "left admitted.",
    )
    request_timeout_s: float = Field(
        default=10.0,
        gt=0,
        description="Bound on all the Redis work of one request, waiting for this process's "
        "event loop included: a burst larger than the gateway serves at once waits its turn "
        "this long before it is refused (503 with `Retry-After`, nothing left admitted). Also "
        "the bound on each read of a result kept in the object store (503 past it).",
    )
    max_body_bytes: int = Field(
        default=1024 * 1024, ge=1024, description="Largest request body; larger is 413."
    )
    body_timeout_s: float = Field(
        default=30.0,
        gt=0,
        description="Longest wait for the next piece of a request body that is not whole yet: "
        "past it the request is 408 and its connection closed (a client that stops sending "
        "cannot hold a connection).",
    )
    head_timeout_s: float = Field(
        default=30.0,
        gt=0,
        description="Longest time a request line and headers may take to arrive whole, from "
        "the first byte after the connection opened or the last response ended: past it the "
        "request is 408 and its connection closed (closed unanswered if no head began). A new "
        "connection that sends nothing is closed after this or the keep-alive time, whichever "
        "is longer.",
    )
    max_admitted_hot: int = Field(
        default=10_000,
        ge=1,
        description="Jobs the hot tier of each pool (base model) holds admitted and unfinished.",
    )
    max_admitted_warm: int = Field(
        default=5_000,
        ge=1,
        description="Jobs the warm tier of each pool (base model) holds admitted and unfinished.",
    )
    max_admitted_cold: int = Field(
        default=2_000,
        ge=1,
        description="Jobs the cold tier of each pool (base model) holds admitted and unfinished.",
    )
    tenant_max_concurrent: int = Field(
        default=1_000, ge=1, description="Default per-tenant limit on unfinished jobs."
    )
    tenant_rate_per_s: float = Field(
        default=100.0, gt=0, description="Default per-tenant sustained admissions per second."
    )
    tenant_burst: int = Field(
        default=500, ge=1, description="Default per-tenant admissions allowed at once."
    )
    admission_retry_after_s: int = Field(
        default=1, ge=1, description="`Retry-After` of a 429 from a concurrency limit."
    )
    idempotency_ttl_s: int = Field(
        default=24 * 3600, gt=0, description="How long an `Idempotency-Key` is remembered."
    )
    completion_timeout_s: float = Field(
        default=300.0,
        gt=0,
        description="How long `/v1/completions` and `/v1/chat/completions` wait for the job; "
        "past it they answer 504 and the job keeps running (`GET /v1/jobs/{id}`).",
    )
    webhook_allow_http: bool = Field(
        default=False, description="Accept http:// callback URLs (local development only)."
    )
    webhook_allow_loopback: bool = Field(
        default=False, description="Accept callbacks to loopback addresses (local development)."
    )
    max_batch_requests: int = Field(
        default=10_000, ge=1, description="Requests one batch may hold."
    )
    max_batch_bytes: int = Field(
        default=64 * 1024 * 1024,
        ge=1024,
        description="Largest batch body or uploaded batch file; larger is 413.",
    )
    prompt_threads: int = Field(
        default=2,
        ge=1,
        description="Threads that render chat templates and count prompt tokens, off the "
        "event loop; requests beyond them wait their turn within their own bound.",
    )
    max_files_per_tenant: int = Field(
        default=100, ge=1, description="Uploaded files (`/v1/files`) one tenant may store."
    )
    max_file_bytes_per_tenant: int = Field(
        default=256 * 1024 * 1024,
        ge=1024,
        description="Bytes of uploaded files one tenant may store; over it (or over the "
        "count) an upload is 429 `file_quota_exceeded`.",
    )
    file_ttl_s: int = Field(
        default=24 * 3600,
        gt=0,
        description="How long an uploaded file is kept (it counts in its tenant's quota "
        "until then, or until deleted).",
    )
    fleet_target_jobs_per_worker: int = Field(
        default=64, ge=1, description="Unfinished jobs one worker should hold (`/v1/fleet`)."
    )
    fleet_max_queue_age_s: float = Field(
        default=30.0, gt=0, description="Oldest waiting job age that asks for one more worker."
    )
    routing: bool = Field(
        default=True,
        description="Route each job to a worker that holds its adapter (or is chosen to), "
        "through that worker's own queue; off: every job goes to its pool queue. "
        'The policy: README, "Routing".',
    )
    route_max_copies: int = Field(
        default=2,
        ge=1,
        description="Workers routing lets hold one adapter; a new copy is placed only when "
        "every holder is overloaded.",
    )
    route_overload_ratio: float = Field(
        default=1.0,
        gt=0,
        description="A worker is overloaded for routing once its running plus waiting jobs "
        "reach this times its concurrency.",
    )
    route_refresh_s: float = Field(
        default=0.5, gt=0, description="How often the gateway reads the fleet's announcements."
    )
    route_view_max_age_s: float = Field(
        default=5.0,
        gt=0,
        description="A view of the fleet older than this (Redis unreachable) is not routed "
        "on: jobs go to the shared queues.",
    )
    metrics_public: bool = Field(
        default=False,
        description="Serve `/metrics` without a key (only where the gateway port is private); "
        "otherwise it takes an operator tenant's key, as Prometheus' `authorization` sends it.",
    )
    popularity_top_k: int = Field(
        default=64,
        ge=1,
        le=10_000,
        description="Adapters per pool whose decayed request counts are kept for the workers' "
        "popularity prefetch (the rest are dropped).",
    )
    metrics_top_adapters: int = Field(
        default=20, ge=0, description="Adapters counted by name in metrics; the rest are 'other'."
    )

    def tier_limit(self, tier: Tier) -> int:
        limits = {
            Tier.HOT: self.max_admitted_hot,
            Tier.WARM: self.max_admitted_warm,
            Tier.COLD: self.max_admitted_cold,
        }
        return limits[tier]


@lru_cache(maxsize=1)
def get_settings() -> GatewaySettings:
    """The process-wide settings, built on first use."""
    return GatewaySettings()
