"""Stable, machine-readable error codes (the ``code`` of every error body)."""

from __future__ import annotations

from enum import StrEnum

from pydantic import BaseModel


class ErrorCode(StrEnum):
    """Every error a caller can see. Never renumber or rename: clients branch on these."""

    ADAPTER_NOT_FOUND = "adapter_not_found"
    VALIDATION_ERROR = "validation_error"
    JOB_NOT_FOUND = "job_not_found"
    SERVICE_UNAVAILABLE = "service_unavailable"
    ADAPTER_INTEGRITY = "adapter_integrity"
    ADAPTER_UNAVAILABLE = "adapter_unavailable"
    BASE_MODEL_MISMATCH = "base_model_mismatch"
    ENGINE_ERROR = "engine_error"
    INTERNAL_ERROR = "internal_error"


class ErrorBody(BaseModel):
    """``{"code": ..., "message": ...}``: the code for machines, the sentence for humans."""

    code: ErrorCode
    message: str
    details: list[dict[str, object]] | None = None
