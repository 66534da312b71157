"""Worker settings: one object per process, read from the environment once."""

from __future__ import annotations

import math
from functools import lru_cache
from pathlib import Path
from typing import Literal, cast, get_args

from pydantic import Field, field_validator, model_validator

from contracts.queues import Tier
from contracts.settings import ServiceSettings

# The ranks vLLM accepts for max_lora_rank; anything else fails at engine start, so refuse early.
LoraRank = Literal[1, 8, 16, 32, 64, 128, 256, 320, 512]
LORA_RANKS: tuple[int, ...] = get_args(LoraRank)


class WorkerSettings(ServiceSettings):
    """Every knob of a worker. Env var = ``LORAFLEET_`` + field name, upper case."""

    model: str = Field(
        default=".lorafleet/fixtures/base",
        description="Base model served by the engine: a local directory or a hub id.",
    )
    dtype: str = Field(default="auto", description="Engine weight dtype (`float32` on CPU).")
    max_model_len: int | None = Field(
        default=None, description="Context length; `None` takes the model's own."
    )
    max_loras: int = Field(
        default=4, ge=1, description="GPU adapter slots; pinned hot adapters hold some of them."
    )
    max_cpu_loras: int = Field(
        default=8, ge=1, description="Adapters kept registered in the engine's CPU cache."
    )
    slot_drain_after_s: float = Field(
        default=0.5,
        ge=0,
        description="How long a job may wait for a GPU adapter slot before the adapter that "
        "has held its slot longest stops taking new jobs so that its slot frees (until then "
        "jobs of adapters in flight join them at once, as in vLLM's scheduler).",
    )
    max_lora_rank: int = Field(
        default=8, description="Largest adapter rank served (one of the ranks vLLM accepts)."
    )
    max_num_seqs: int | None = Field(
        default=None,
        ge=1,
        description="Sequences the engine schedules in one step; `None`: what `vllm serve` "
        "takes on this hardware (vLLM's server defaults).",
    )
    max_num_batched_tokens: int | None = Field(
        default=None,
        ge=1,
        description="Tokens the engine processes in one step (prefill chunks included); "
        "`None`: vLLM's server default for this hardware.",
    )
    gpu_memory_utilization: float = Field(
        default=0.9, gt=0, le=1, description="Fraction of accelerator memory vLLM may use."
    )
    enforce_eager: bool = Field(
        default=False, description="Disable CUDA graphs / compilation (required on CPU)."
    )
    colocate_engine_core: bool = Field(
        default=False,
        description="CPU engines: run vLLM's engine-core process on the cores its model worker "
        "is bound to (`VLLM_CPU_OMP_THREADS_BIND`), leaving the reserved cores to this worker's "
        "consumer and job threads.",
    )
    cache_dir: Path = Field(
        default=Path(".lorafleet/cache"), description="Local disk cache of adapter artifacts."
    )
    disk_cache_bytes: int = Field(
        default=20 * 1024**3, gt=0, description="Byte bound of the local adapter disk cache (LRU)."
    )
    disk_eviction: Literal["cost", "lru"] = Field(
        default="cost",
        description="Which disk cache entry goes first when space is needed: `cost`, the "
        "least (decayed request rate x measured fetch time) per byte; `lru`, the least "
        "recently used.",
    )
    disk_rate_half_life_s: float = Field(
        default=600.0,
        gt=0,
        description="Half-life of the per-adapter request rate the `cost` eviction weighs.",
    )
    prediction: Literal["off", "lookahead", "popularity"] = Field(
        default="lookahead",
        description="Prefetching: `lookahead` fetches and verifies the adapters of jobs "
        "waiting in this worker's queues (the next `LORAFLEET_LOOKAHEAD_JOBS` of each) into "
        "the disk cache before their jobs are taken, and registers them in the engine while "
        "it has a free CPU place and no job waits for a GPU slot; `popularity` also keeps the "
        "pool's `LORAFLEET_POPULARITY_PREFETCH` most asked-for adapters (the gateways' decayed "
        "counts) in free disk room and free engine places, and warms them up before the "
        "worker takes jobs; `off` fetches on demand.",
    )
    popularity_prefetch: int = Field(
        default=16,
        ge=1,
        le=1000,
        description="With `LORAFLEET_PREDICTION=popularity`: how many of the pool's most "
        "asked-for adapters a worker keeps prefetched (into free room only: it never evicts "
        "for them), and warms up at start.",
    )
    popularity_check_s: float = Field(
        default=5.0, gt=0, description="How often the pool's popularity is read (one round trip)."
    )
    warmup_timeout_s: float = Field(
        default=60.0,
        ge=0,
        description="How long a starting worker may spend warming up popular adapters before "
        "it takes jobs.",
    )
    lookahead_jobs: int = Field(
        default=16,
        ge=1,
        le=1000,
        description="Waiting jobs looked at per queue per pass (whole messages, prompts "
        "included, are read: mind the bytes).",
    )
    prefetch_interval_s: float = Field(
        default=0.5, gt=0, description="How often the look-ahead reads the queues' heads."
    )
    disk_wait_s: float = Field(
        default=60.0,
        gt=0,
        description="How long a download waits for in-use adapters to free disk cache space.",
    )
    result_offload_bytes: int = Field(
        default=16384,
        ge=0,
        description="A result whose JSON is larger than this is written to the object store "
        "(`results/<tenant>/sha256/...`) and its record keeps only a reference; 0 keeps "
        "every result in Redis.",
    )
    visibility_timeout_s: int = Field(
        default=900,
        gt=0,
        description="Seconds after delivery before Redis hands an unacknowledged job to another "
        "worker; must exceed `job_deadline_s`, so only a dead worker's jobs are redelivered.",
    )
    restore_interval_s: float = Field(
        default=10.0,
        gt=0,
        description="How often each worker returns jobs past the visibility timeout to their "
        "queue; a dead worker's job reruns within visibility timeout + this.",
    )
    max_attempts: int = Field(
        default=3,
        ge=1,
        description="Starts a job may have; one more delivery fails it with `attempts_exhausted` "
        "(a job that kills its worker every time).",
    )
    prefetch_multiplier: int = Field(
        default=1,
        ge=1,
        description="Jobs reserved per pool thread; 1 keeps a busy worker from hoarding a queue.",
    )
    receive_batch: int = Field(
        default=16,
        ge=1,
        le=1024,
        description="Jobs one receipt may take from a queue (within the free prefetch); above 1 "
        "the worker receives in batches (`worker/receive.py`): a burst of n costs one `BRPOP` "
        "and one script instead of n of each. 1: one at a time, as kombu reads.",
    )
    drain_timeout_s: float = Field(
        default=120.0,
        ge=0,
        description="On SIGTERM, how long running jobs may finish; past it they are aborted "
        "and handed back to the queue. Keep below the orchestrator's grace period.",
    )
    lease_ttl_s: float = Field(
        default=60.0,
        gt=0,
        description="How long a running attempt's lease outlives its last renewal (renewed "
        "every quarter of it). A Redis outage shorter than this never starts a second attempt "
        "of a running job; a dead worker's running jobs wait this long for their lease.",
    )
    engine_check_s: float = Field(
        default=1.0, gt=0, description="How often the worker reads vLLM's own engine health."
    )
    engine_probe_s: float = Field(
        default=5.0,
        gt=0,
        description="How often the worker probes its engine with a round trip through the "
        "engine loop and the engine core.",
    )
    engine_probe_timeout_s: float = Field(
        default=30.0,
        gt=0,
        description="A probe unanswered this long, with no engine step returning outputs in "
        "its last half, means the engine is wedged: the worker stops consuming, hands its jobs "
        "back and exits.",
    )
    engine_failure_exit_s: float = Field(
        default=30.0,
        gt=0,
        description="Once the engine failed, how long the worker takes at most to hand its jobs "
        "back and exit (with code 75); past it, it exits at once.",
    )
    cancel_poll_s: float = Field(
        default=2.0,
        gt=0,
        description="Sweep of running jobs' statuses, catching cancellations the pub/sub "
        "message missed.",
    )
    heartbeat_s: float = Field(
        default=10.0,
        gt=0,
        description="Worker heartbeat period; a worker silent for 4 periods + 2 s is dead and "
        "its jobs go back to their queues.",
    )
    residency_publish_s: float = Field(
        default=1.0,
        gt=0,
        description="How often a worker publishes the adapters it holds and its load for "
        "routing (and within 0.2 s of a change of its adapters).",
    )
    pin_check_s: float = Field(
        default=2.0,
        gt=0,
        description="How often a worker checks the registry's version for hot adapters "
        "published or retired since (one GET), to pin or unpin them live.",
    )
    route_max_wait_s: float = Field(
        default=5.0,
        gt=0,
        description="A routed job still waiting in a worker's own queue this long after "
        "admission goes back to its tier's shared queue (checked every restore interval).",
    )
    tiers: str = Field(
        default="hot,warm,cold",
        description="Tiers this worker takes, comma-separated: it consumes their queues for "
        "its base model (`lorafleet.<tier>.<pool id>`) and its own queue; it pins hot "
        "adapters only if it takes hot, preloads warm ones only if it takes warm. Empty: "
        "no tier (only jobs pushed onto its own queue; nothing is routed to it).",
    )
    worker_concurrency: int = Field(
        default=256, ge=1, description="Jobs in flight (the Procfile's Celery --concurrency)."
    )
    metrics_port: int = Field(
        default=9400,
        ge=0,
        le=65535,
        description="Prometheus metrics port (the next free one if taken; 0: any free port).",
    )

    @field_validator("tiers")
    @classmethod
    def _known_tiers(cls, value: str) -> str:
        names = [name.strip() for name in value.split(",") if name.strip()]
        unknown = sorted(set(names) - {tier.value for tier in Tier})
        if unknown:
            raise ValueError(f"unknown tiers {unknown}: take some of hot, warm, cold")
        return ",".join(dict.fromkeys(names))

    @property
    def tier_list(self) -> tuple[Tier, ...]:
        """The tiers this worker takes, in the order given."""
        return tuple(Tier(name) for name in self.tiers.split(",") if name)

    @field_validator("max_lora_rank")
    @classmethod
    def _rank_vllm_accepts(cls, value: int) -> int:
        if value not in LORA_RANKS:
            raise ValueError(f"max_lora_rank must be one of {list(LORA_RANKS)}")
        return value

    @property
    def lora_rank(self) -> LoraRank:
        return cast(LoraRank, self.max_lora_rank)

    @model_validator(mode="after")
    def _consistent(self) -> WorkerSettings:
        if self.max_cpu_loras < self.max_loras:
            raise ValueError("max_cpu_loras must be at least max_loras")
        # Otherwise Redis could hand a still-running job to a second worker, or restore a
        # dead worker's job that the reaper already handed to another one.
        floor = self.job_deadline_s + self.announcement_ttl_s + self.restore_interval_s
        if self.visibility_timeout_s <= floor:
            raise ValueError(
                "visibility_timeout_s must exceed job_deadline_s + the worker announcement TTL "
                f"(4 x heartbeat_s + 2) + restore_interval_s = {floor:g} s"
            )
        return self

    @property
    def announcement_ttl_s(self) -> int:
        """Seconds a worker's heartbeat key outlives its last beat."""
        return math.ceil(self.heartbeat_s * 4) + 2

    @property
    def lease_refresh_s(self) -> float:
        """How often a worker renews the leases of its running attempts."""
        return self.lease_ttl_s / 4

    @property
    def lease_rejoin_s(self) -> float:
        """Right after a Redis outage, how long a running job without a lease is left to the
        attempt that ran it to take its lease back before another delivery claims it."""
        return 2 * self.lease_refresh_s + 1

    @property
    def safe_deadline_s(self) -> float:
        """The longest job deadline this worker's visibility timeout covers."""
        return self.visibility_timeout_s - self.announcement_ttl_s - self.restore_interval_s

    def covers(self, deadline_s: float) -> bool:
        """A job with this deadline (from admission) is acknowledged before Redis would hand
        it to another worker: the visibility timeout outlasts it."""
        return deadline_s <= self.safe_deadline_s


@lru_cache(maxsize=1)
def get_settings() -> WorkerSettings:
    """The process-wide settings, built on first use."""
    return WorkerSettings()
