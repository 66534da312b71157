"""Batches: many jobs submitted at once, tracked together, reported in submission order.

One shape serves lorafleet's own batch API and OpenAI's Batch API: ``BatchPublic`` carries
every field of OpenAI's ``Batch`` object plus lorafleet's counts, progress and webhook.
The counts live in the batch's hash and are advanced by the same script that records each
job's outcome (``contracts.job_records``), so they are exact.
"""

from __future__ import annotations

from typing import Literal

from pydantic import BaseModel, Field

from contracts.webhooks import WebhookStatus, WebhookTarget

BatchEndpoint = Literal["/v1/jobs", "/v1/completions", "/v1/chat/completions"]


class BatchLine(BaseModel):
    """How one request of a batch is reported: its caller-given id, its job, its shape."""

    custom_id: str
    job_id: str
    endpoint: BatchEndpoint
    model: str


class BatchRecord(BaseModel):
    """What is fixed when a batch is created (``record`` field of the batch hash)."""

    id: str
    tenant: str
    endpoint: BatchEndpoint
    input_file_id: str | None = None
    completion_window: str = "24h"
    created_at: int
    expires_at: int
    webhook: WebhookTarget | None = None
    metadata: dict[str, str] | None = None


class RequestCounts(BaseModel):
    """OpenAI's counts: ``completed`` succeeded, ``failed`` did not (failed or cancelled)."""

    total: int
    completed: int
    failed: int


class BatchCounts(BaseModel):
    pending: int = Field(description="queued or running")
    succeeded: int
    failed: int
    cancelled: int


BatchStatus = Literal["in_progress", "cancelling", "completed", "cancelled"]


class BatchPublic(BaseModel):
    id: str
    object: Literal["batch"] = "batch"
    endpoint: BatchEndpoint
    input_file_id: str | None
    completion_window: str
    status: BatchStatus
    output_file_id: str | None = None
    error_file_id: str | None = None
    errors: None = None
    created_at: int
    in_progress_at: int
    expires_at: int
    completed_at: int | None = None
    cancelled_at: int | None = None
    request_counts: RequestCounts
    metadata: dict[str, str] | None = None
    counts: BatchCounts
    progress: float = Field(description="finished jobs / all jobs, 0 to 1")
    webhook: WebhookTarget | None = None
    webhook_delivery: WebhookStatus | None = None


def output_file_id(batch_id: str) -> str:
    return f"file-batch-{batch_id}-output"


def error_file_id(batch_id: str) -> str:
    return f"file-batch-{batch_id}-errors"


def batch_public(fields: dict[str, str]) -> BatchPublic:
    """The public batch from its hash (``record`` plus the counters)."""
    record = BatchRecord.model_validate_json(fields["record"])
    total = int(fields.get("total") or 0)
    counts = {name: int(fields.get(name) or 0) for name in ("succeeded", "failed", "cancelled")}
    finished = int(fields.get("finished") or 0)
    cancel_requested = "cancel_requested_at" in fields
    done = finished >= total
    status: BatchStatus
    if done:
        status = "cancelled" if cancel_requested else "completed"
    else:
        status = "cancelling" if cancel_requested else "in_progress"
    completed_at = int(float(fields["completed_at"])) if "completed_at" in fields else None
    return BatchPublic(
        id=record.id,
        endpoint=record.endpoint,
        input_file_id=record.input_file_id,
        completion_window=record.completion_window,
        status=status,
        output_file_id=output_file_id(record.id) if done else None,
        error_file_id=error_file_id(record.id) if done else None,
        created_at=record.created_at,
        in_progress_at=record.created_at,
        expires_at=record.expires_at,
        completed_at=completed_at if status == "completed" else None,
        cancelled_at=completed_at if status == "cancelled" else None,
        request_counts=RequestCounts(
            total=total,
            completed=counts["succeeded"],
            failed=counts["failed"] + counts["cancelled"],
        ),
        metadata=record.metadata,
        counts=BatchCounts(pending=total - finished, **counts),
        progress=round(finished / total, 4) if total else 1.0,
        webhook=record.webhook,
    )
