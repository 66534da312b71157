"""How every lorafleet process connects to Redis.

A process shares one client among all its requests or job threads. Its pool blocks when all
``max_connections`` are busy and hands the next free connection over, rather than failing
the command (redis-py's default pool raises ``MaxConnectionsError`` past 100 at once).

A restarted (or failed-over) server closes every pooled connection; without a retry the first
command on each of them fails. A command is retried once on a fresh connection, so a restart
costs a little latency, and a server that stays down still fails fast for the caller to
handle (the gateway answers 503; the worker waits for Redis before writing an outcome).
"""

from __future__ import annotations

from typing import Any

from redis import BlockingConnectionPool, Redis
from redis.asyncio import BlockingConnectionPool as AsyncBlockingConnectionPool
from redis.asyncio import Redis as AsyncRedis
from redis.asyncio.retry import Retry as AsyncRetry
from redis.backoff import ExponentialBackoff
from redis.exceptions import ConnectionError, TimeoutError
from redis.retry import Retry

RETRIES = 1
_BACKOFF = {"cap": 0.5, "base": 0.05}


def sync_options(retries: int = RETRIES) -> dict[str, Any]:
    """Keyword arguments for ``redis.Redis.from_url``. ``retries=0``: a command that fails
    is never resent by the client (for callers whose writes must not run twice unasked)."""
    return {
        "retry": Retry(ExponentialBackoff(**_BACKOFF), retries),
        "retry_on_error": [ConnectionError, TimeoutError],
    }


def async_options(retries: int = RETRIES) -> dict[str, Any]:
    """Keyword arguments for ``redis.asyncio.Redis.from_url`` (``retries``: as above)."""
    return {
        "retry": AsyncRetry(ExponentialBackoff(**_BACKOFF), retries),
        "retry_on_error": [ConnectionError, TimeoutError],
    }


def sync_client(
    url: str,
    max_connections: int,
    pool_timeout_s: float | None = 30.0,
    retries: int = RETRIES,
    **options: Any,
) -> Redis:
    """A client whose commands wait up to ``pool_timeout_s`` for a free connection."""
    pool = BlockingConnectionPool.from_url(
        url,
        max_connections=max_connections,
        timeout=pool_timeout_s,
        **sync_options(retries),
        **options,
    )
    return Redis.from_pool(pool)


def async_client(
    url: str, max_connections: int, pool_timeout_s: float | None, **options: Any
) -> AsyncRedis:
    """The asyncio twin of ``sync_client``."""
    pool = AsyncBlockingConnectionPool.from_url(
        url, max_connections=max_connections, timeout=pool_timeout_s, **async_options(), **options
    )
    return AsyncRedis.from_pool(pool)
