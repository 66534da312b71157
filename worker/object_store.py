"""The S3 client every worker-side process builds the same way (the GPU worker for adapters
and results, the webhook worker for results)."""

from __future__ import annotations

from typing import Any

import boto3
from botocore.config import Config

from contracts.settings import ServiceSettings


def s3_client(
    settings: ServiceSettings,
    connect_timeout_s: float = 5,
    read_timeout_s: float = 30,
    max_attempts: int | None = None,
) -> Any:
    """``max_attempts``: botocore's retries after the first call (default: the setting)."""
    retries = settings.s3_max_attempts if max_attempts is None else max_attempts
    return boto3.client(
        "s3",
        endpoint_url=settings.s3_endpoint_url,
        region_name=settings.s3_region,
        config=Config(
            retries={"max_attempts": retries, "mode": "standard"},
            connect_timeout=connect_timeout_s,
            read_timeout=read_timeout_s,
        ),
    )
