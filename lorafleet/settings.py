"""Settings of the CLI and the local stack (not of the gateway or worker processes)."""

from __future__ import annotations

from pathlib import Path

from pydantic import Field
from pydantic_settings import BaseSettings, SettingsConfigDict


class LocalSettings(BaseSettings):
    """Env var = ``LORAFLEET_`` + field name. Unset Redis/S3 means: start private servers."""

    model_config = SettingsConfigDict(env_prefix="LORAFLEET_", extra="ignore")

    state_dir: Path = Field(
        default=Path(".lorafleet"), description="Where the local stack keeps its state and logs."
    )
    redis_url: str | None = Field(
        default=None, description="Use this Redis instead of starting a private Valkey server."
    )
    s3_endpoint_url: str | None = Field(
        default=None, description="Use this S3 endpoint instead of starting a moto server."
    )
    s3_bucket: str = Field(default="lorafleet", description="Bucket holding adapter artifacts.")
    s3_region: str = Field(default="us-east-1", description="Region for the S3 client.")
    model: Path | None = Field(
        default=None, description="Base model directory; default: the generated fixture model."
    )
    gateway_port: int = Field(default=0, ge=0, description="Gateway port; 0 picks a free one.")
    startup_timeout_s: float = Field(
        default=600.0, gt=0, description="How long `stack up` waits for every service to be ready."
    )

    @property
    def fixtures_dir(self) -> Path:
        return self.state_dir / "fixtures"

    @property
    def stack_file(self) -> Path:
        return self.state_dir / "stack.json"
