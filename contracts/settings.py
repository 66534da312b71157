"""What every lorafleet service reads the same way: where Redis and the broker are, how many
Redis connections it may open, and where errors go."""

from __future__ import annotations

from pydantic import Field
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

    @property
    def effective_broker_url(self) -> str:
        return self.broker_url or self.redis_url
