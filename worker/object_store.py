"""The S3 client every worker-side process builds the same way (the GPU worker for adapters
and results, the webhook worker for results)."""

from __future__ import annotations

from typing import Any

import boto3
from botocore.config import Config

from contracts.settings import ServiceSettings


def s3_client(settings: ServiceSettings) -> Any:
    return boto3.client(
        "s3",
        endpoint_url=settings.s3_endpoint_url,
        region_name=settings.s3_region,
        config=Config(
            retries={"max_attempts": settings.s3_max_attempts, "mode": "standard"},
            connect_timeout=5,
            read_timeout=30,
        ),
    )
