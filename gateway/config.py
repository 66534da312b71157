"""Gateway settings: one object per process, read from the environment once."""

from __future__ import annotations

from functools import lru_cache

from pydantic import Field
from pydantic_settings import BaseSettings, SettingsConfigDict


class GatewaySettings(BaseSettings):
    """Every knob of the gateway. Env var = ``LORAFLEET_`` + field name, upper case."""

    model_config = SettingsConfigDict(env_prefix="LORAFLEET_", extra="ignore")

    redis_url: str = Field(
        default="redis://127.0.0.1:6379/0",
        description="Redis holding the registry, job records and (by default) the queues.",
    )
    broker_url: str | None = Field(
        default=None, description="Celery broker URL; defaults to `redis_url`."
    )
    redis_timeout_s: float = Field(
        default=2.0, gt=0, description="Bound on any single Redis call made by the gateway."
    )
    job_ttl_s: int = Field(
        default=7 * 24 * 3600, gt=0, description="How long job records and results are kept."
    )
    job_deadline_s: float = Field(
        default=600.0, gt=0, description="Default and largest per-job deadline, from admission."
    )
    sentry_dsn: str | None = Field(
        default=None,
        validation_alias="SENTRY_DSN",
        description="Report unhandled errors to Sentry when set.",
    )

    @property
    def effective_broker_url(self) -> str:
        return self.broker_url or self.redis_url


@lru_cache(maxsize=1)
def get_settings() -> GatewaySettings:
    """The process-wide settings, built on first use."""
    return GatewaySettings()
