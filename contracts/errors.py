"""Stable, machine-readable error codes (the ``code`` of every error body)."""

from __future__ import annotations

from enum import StrEnum

from pydantic import BaseModel


class ErrorCode(StrEnum):
    """Every error a caller can see. Never renumber or rename: clients branch on these."""

    # Admission (gateway)
    ADAPTER_NOT_FOUND = "adapter_not_found"
    ADAPTER_RETIRED = "adapter_retired"
    VALIDATION_ERROR = "validation_error"
    ROUTE_NOT_FOUND = "route_not_found"
    METHOD_NOT_ALLOWED = "method_not_allowed"
    JOB_NOT_FOUND = "job_not_found"
    JOB_FINISHED = "job_finished"
    SERVICE_UNAVAILABLE = "service_unavailable"
    UNAUTHORIZED = "unauthorized"
    FORBIDDEN = "forbidden"
    TIER_LIMIT_EXCEEDED = "tier_limit_exceeded"
    TENANT_CONCURRENCY_EXCEEDED = "tenant_concurrency_exceeded"
    TENANT_RATE_EXCEEDED = "tenant_rate_exceeded"
    PAYLOAD_TOO_LARGE = "payload_too_large"
    HEADERS_TOO_LARGE = "headers_too_large"
    MALFORMED_REQUEST = "malformed_request"
    HEADER_TIMEOUT = "header_timeout"
    BODY_TIMEOUT = "body_timeout"
    UNSUPPORTED_MEDIA_TYPE = "unsupported_media_type"
    PROMPT_TOO_LONG = "prompt_too_long"
    IDEMPOTENCY_CONFLICT = "idempotency_conflict"
    UNSUPPORTED_PARAMETER = "unsupported_parameter"
    WEBHOOK_URL_FORBIDDEN = "webhook_url_forbidden"
    BATCH_INVALID = "batch_invalid"
    BATCH_TOO_LARGE = "batch_too_large"
    BATCH_EXCEEDS_LIMITS = "batch_exceeds_limits"
    FILE_QUOTA_EXCEEDED = "file_quota_exceeded"
    BATCH_NOT_FOUND = "batch_not_found"
    FILE_NOT_FOUND = "file_not_found"
    TIMEOUT = "timeout"
    # Execution (worker): the job ends failed, generation never ran on other weights
    ADAPTER_INTEGRITY = "adapter_integrity"
    ADAPTER_UNAVAILABLE = "adapter_unavailable"
    ADAPTER_LOAD_FAILED = "adapter_load_failed"
    BASE_MODEL_MISMATCH = "base_model_mismatch"
    ENGINE_ERROR = "engine_error"
    DEADLINE_EXCEEDED = "deadline_exceeded"
    ATTEMPTS_EXHAUSTED = "attempts_exhausted"
    CANCELLED = "cancelled"
    INTERNAL_ERROR = "internal_error"
    # Tenants and keys (CLI)
    TENANT_NOT_FOUND = "tenant_not_found"
    TENANT_EXISTS = "tenant_exists"
    KEY_NOT_FOUND = "key_not_found"
    # Publishing and registry management (CLI): nothing is uploaded or registered
    NAME_INVALID = "name_invalid"
    NAME_TAKEN = "name_taken"
    PINS_EXCEED_SLOTS = "pins_exceed_slots"
    CHANNEL_NOT_FOUND = "channel_not_found"
    ALIAS_EXISTS = "alias_exists"
    ADAPTER_CONFIG_MISSING = "adapter_config_missing"
    ADAPTER_CONFIG_INVALID = "adapter_config_invalid"
    ADAPTER_UNSAFE_FORMAT = "adapter_unsafe_format"
    ADAPTER_WEIGHTS_MISSING = "adapter_weights_missing"
    ADAPTER_WEIGHTS_INVALID = "adapter_weights_invalid"
    RANK_TOO_LARGE = "rank_too_large"
    TARGET_MODULES_UNKNOWN = "target_modules_unknown"
    ADAPTER_SHAPE_MISMATCH = "adapter_shape_mismatch"
    ADAPTER_TOO_LARGE = "adapter_too_large"


class ErrorBody(BaseModel):
    """``{"code": ..., "message": ...}``: the code for machines, the sentence for humans."""

    code: ErrorCode
    message: str
    details: list[dict[str, object]] | None = None
