"""What every lorafleet service reads the same way: where Redis and the broker are, how many
Redis connections it may open, where errors go, and the job limits both sides must agree on
(the deadline the gateway stamps is the one the worker's delivery settings are checked
against: one setting, not two copies that can drift)."""

from __future__ import annotations

from pydantic import Field, model_validator
from pydantic_settings import BaseSettings, SettingsConfigDict


class ServiceSettings(BaseSettings):
    """Env var = ``LORAFLEET_`` + field name, upper case (``SENTRY_DSN`` as is)."""

    model_config = SettingsConfigDict(env_prefix="LORAFLEET_", extra="ignore")

    redis_url: str = Field(
        default="redis://127.0.0.1:6379/0",
        description="Redis holding the registry, job records and (by default) the queues.",
    )
    broker_url: str | None = Field(
        default=None, description="Celery broker URL; defaults to `redis_url`."
    )
    redis_max_connections: int = Field(
        default=128,
        ge=1,
        description="Redis connections one process opens at most; commands beyond wait for a "
        "free one instead of failing.",
    )
    sentry_dsn: str | None = Field(
        default=None,
        validation_alias="SENTRY_DSN",
        description="Report unhandled errors to Sentry when set.",
    )
    s3_endpoint_url: str | None = Field(
        default=None, description="S3-compatible endpoint (MinIO, R2, moto); `None` is AWS S3."
    )
    s3_bucket: str = Field(
        default="lorafleet", description="Bucket holding adapter artifacts and large results."
    )
    s3_region: str = Field(default="us-east-1", description="Region for the S3 client.")
    s3_max_attempts: int = Field(
        default=4,
        ge=1,
        description="Retries of a failed adapter download call after the first (botocore's "
        "standard mode `max_attempts`); results are read and written with one retry.",
    )
    job_ttl_s: int = Field(
        default=24 * 3600,
        gt=0,
        description="How long a job's record and result, a batch's record and a webhook "
        "event are kept after their last change.",
    )
    job_deadline_s: float = Field(
        default=600.0,
        gt=0,
        description="Default and largest per-job deadline, from admission (the gateway stamps "
        "it; the worker's visibility timeout must exceed it).",
    )
    sweep_interval_s: float = Field(
        default=5.0,
        gt=0,
        description="How often the elected deadline sweeper looks for jobs past their deadline.",
    )
    sweep_grace_s: float = Field(
        default=10.0,
        ge=0,
        description="How long past its deadline an unfinished job is left to its worker before "
        "the sweeper fails it `deadline_exceeded`.",
    )

    @model_validator(mode="after")
    def _records_outlive_jobs(self) -> ServiceSettings:
        # A job's record is written with this TTL at admission: a record that expired before
        # its job ended would turn an accepted job into a 404, its ledger entries orphaned.
        floor = self.job_deadline_s + self.sweep_grace_s + self.sweep_interval_s
        if self.job_ttl_s <= floor:
            raise ValueError(
                "job_ttl_s must exceed job_deadline_s + sweep_grace_s + sweep_interval_s "
                f"= {floor:g} s (an unfinished job's record must outlive it)"
            )
        return self

    @property
    def effective_broker_url(self) -> str:
        return self.broker_url or self.redis_url
