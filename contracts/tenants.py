"""Tenants, API keys and grants: the records the gateway authenticates and authorises with.

An API key is ``lf_<key id>_<secret>``; only its SHA-256 is stored (keys are 256-bit random
strings, so a fast hash is enough and a lookup by hash leaks nothing through timing). The key
id is public: it names the key in listings, revocation and rotation.
"""

from __future__ import annotations

import hashlib
import secrets
from datetime import datetime

from pydantic import BaseModel, ConfigDict, Field

from contracts.registry import SLUG_PATTERN

KEY_PREFIX = "lf_"
ALL_ADAPTERS = "*"
"""The grant that covers every adapter and channel, present and future (the local ``dev``
tenant has it)."""


class TenantLimits(BaseModel):
    """Per-tenant admission limits; ``None`` takes the gateway's default."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    max_concurrent: int | None = Field(default=None, ge=1, description="jobs admitted, unfinished")
    rate_per_s: float | None = Field(default=None, gt=0, description="sustained admissions/s")
    burst: int | None = Field(default=None, ge=1, description="admissions allowed at once")


class TenantRecord(BaseModel):
    model_config = ConfigDict(frozen=True, extra="forbid")

    name: str = Field(pattern=SLUG_PATTERN)
    created_at: datetime
    limits: TenantLimits = Field(default_factory=TenantLimits)
    operator: bool = Field(default=False, description="may read fleet-wide state (/v1/fleet)")


class ApiKeyRecord(BaseModel):
    """What is stored for one key (under the hash of the key; never the key itself)."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    key_id: str
    tenant: str
    created_at: datetime
    expires_at: datetime | None = Field(
        default=None, description="set on a rotated key during its grace period"
    )

    @property
    def prefix(self) -> str:
        """How the key is shown: its public part only."""
        return f"{KEY_PREFIX}{self.key_id}_…"


def new_api_key() -> tuple[str, str]:
    """A fresh ``(key id, plaintext key)``."""
    key_id = secrets.token_hex(6)
    return key_id, f"{KEY_PREFIX}{key_id}_{secrets.token_urlsafe(32)}"


def key_hash(api_key: str) -> str:
    return hashlib.sha256(api_key.encode()).hexdigest()
