"""Webhook worker settings: one object per process, read from the environment once."""

from __future__ import annotations

from functools import lru_cache

from pydantic import Field, model_validator

from contracts.settings import ServiceSettings


class WebhookSettings(ServiceSettings):
    """Every knob of a webhook worker. Env var = ``LORAFLEET_`` + field name, upper case."""

    webhook_timeout_s: float = Field(
        default=10.0, gt=0, description="Bound on one callback attempt (connect + response)."
    )
    webhook_max_response_bytes: int = Field(
        default=4096, ge=0, description="Response body read from a receiver, at most."
    )
    webhook_backoff_s: float = Field(
        default=5.0, gt=0, description="Delay before the first retry; doubles each attempt."
    )
    webhook_backoff_max_s: float = Field(
        default=3600.0, gt=0, description="Longest delay between two attempts."
    )
    webhook_retry_window_s: float = Field(
        default=23 * 3600.0,
        gt=0,
        description="Past this long after the event, a failing delivery is marked dead; "
        "shorter than `job_ttl_s` (the payload is the job's record, kept that long).",
    )
    webhook_allow_http: bool = Field(
        default=False, description="Allow http:// callback URLs (local development only)."
    )
    webhook_allow_loopback: bool = Field(
        default=False, description="Allow callbacks to loopback addresses (local development)."
    )
    webhook_poll_s: float = Field(
        default=0.5, gt=0, description="How often the dispatcher looks for due deliveries."
    )

    @model_validator(mode="after")
    def _window_within_retention(self) -> WebhookSettings:
        if self.webhook_retry_window_s >= self.job_ttl_s:
            raise ValueError(
                "webhook_retry_window_s must be shorter than job_ttl_s "
                f"({self.job_ttl_s} s): a retry after the job's record expired has nothing to "
                "send, and its event would end dead inside its window"
            )
        return self

    @property
    def lease_s(self) -> float:
        """How long a dispatched attempt owns its event before it may be dispatched again:
        well past the attempt's own bound, so a live attempt is never doubled."""
        return 3 * self.webhook_timeout_s + 30


@lru_cache(maxsize=1)
def get_settings() -> WebhookSettings:
    return WebhookSettings()
