"""Settings of the CLI and the local stack (not of the gateway or worker processes)."""

from __future__ import annotations

from pathlib import Path

from pydantic import Field
from pydantic_settings import BaseSettings, SettingsConfigDict

from lorafleet.validation import Limits


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
    max_lora_rank: int = Field(
        default=8, ge=1, description="Largest adapter rank the fleet serves (refused above)."
    )
    max_adapter_file_bytes: int = Field(
        default=2 * 1024**3, gt=0, description="Largest adapter file accepted at publish."
    )
    max_adapter_bytes: int = Field(
        default=4 * 1024**3, gt=0, description="Largest adapter (all files) accepted at publish."
    )
    redis_maxmemory_bytes: int = Field(
        default=1024**3,
        ge=16 * 1024**2,
        description="`maxmemory` of the private Valkey server (policy `noeviction`: a full "
        "Redis refuses writes, answered 503, and never drops a record, ledger entry or job).",
    )
    gateway_port: int = Field(default=0, ge=0, description="Gateway port; 0 picks a free one.")
    startup_timeout_s: float = Field(
        default=600.0, gt=0, description="How long `stack up` waits for every service to be ready."
    )

    @property
    def limits(self) -> Limits:
        return Limits(
            max_lora_rank=self.max_lora_rank,
            max_file_bytes=self.max_adapter_file_bytes,
            max_total_bytes=self.max_adapter_bytes,
        )

    @property
    def fixtures_dir(self) -> Path:
        return self.state_dir / "fixtures"

    @property
    def stack_file(self) -> Path:
        return self.state_dir / "stack.json"
