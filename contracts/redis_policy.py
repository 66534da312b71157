"""How every lorafleet process connects to Redis.

A restarted (or failed-over) server closes every pooled connection; without a retry the first
command on each of them fails. A command is retried once on a fresh connection, so a restart
costs a little latency, and a server that stays down still fails fast for the caller to
handle (the gateway answers 503; the worker waits for Redis before writing an outcome).
"""

from __future__ import annotations

from typing import Any

from redis.asyncio.retry import Retry as AsyncRetry
from redis.backoff import ExponentialBackoff
from redis.exceptions import ConnectionError, TimeoutError
from redis.retry import Retry

RETRIES = 1
_BACKOFF = {"cap": 0.5, "base": 0.05}


def sync_options() -> dict[str, Any]:
    """Keyword arguments for ``redis.Redis.from_url``."""
    return {
        "retry": Retry(ExponentialBackoff(**_BACKOFF), RETRIES),
        "retry_on_error": [ConnectionError, TimeoutError],
    }


def async_options() -> dict[str, Any]:
    """Keyword arguments for ``redis.asyncio.Redis.from_url``."""
    return {
        "retry": AsyncRetry(ExponentialBackoff(**_BACKOFF), RETRIES),
        "retry_on_error": [ConnectionError, TimeoutError],
    }
