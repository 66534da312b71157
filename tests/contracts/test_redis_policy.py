"""More concurrent commands than a process's Redis connections: they wait for a free one.

redis-py's default pool raises ``MaxConnectionsError`` past its limit; a worker runs hundreds
of job threads and the gateway hundreds of requests on one client each.
"""

from __future__ import annotations

import asyncio
import uuid
from concurrent.futures import ThreadPoolExecutor

from redis import ConnectionPool, Redis
from redis.exceptions import ConnectionError

from contracts.redis_policy import async_client, sync_client
from lorafleet.stack import LocalStack

COMMANDS = 40
LIMIT = 3


def _slow(client: Redis, key: str) -> object:
    # Holds its connection for 0.1 s, so the commands overlap.
    return client.blpop([key], timeout=0.1)


def _clients_named(redis: Redis, name: str) -> int:
    return sum(1 for c in redis.client_list() if c.get("name") == name)


def test_sync_client_queues_commands_beyond_its_connections(
    infra: LocalStack, redis: Redis
) -> None:
    name = f"policy-{uuid.uuid4().hex[:8]}"
    client = sync_client(infra.redis_url, LIMIT, client_name=name)
    key = f"lorafleet:test:{name}"
    with ThreadPoolExecutor(COMMANDS) as pool:
        results = list(pool.map(lambda _: _slow(client, key), range(COMMANDS)))
        assert _clients_named(redis, name) <= LIMIT
    assert results == [None] * COMMANDS
    client.close()


def test_redis_py_default_pool_fails_the_same_burst(infra: LocalStack) -> None:
    """The failure ``sync_client`` exists for, so the test above can tell the difference."""
    client = Redis.from_pool(ConnectionPool.from_url(infra.redis_url, max_connections=LIMIT))
    with ThreadPoolExecutor(COMMANDS) as executor:
        futures = [executor.submit(_slow, client, "lorafleet:test:none") for _ in range(COMMANDS)]
        errors = [f.exception() for f in futures]
    assert any(isinstance(e, ConnectionError) for e in errors)
    client.close()


def test_async_client_queues_commands_beyond_its_connections(infra: LocalStack) -> None:
    async def burst() -> list[object]:
        client = async_client(infra.redis_url, LIMIT, pool_timeout_s=5.0)
        try:
            key = f"lorafleet:test:{uuid.uuid4().hex}"
            return list(
                await asyncio.gather(*(client.blpop([key], timeout=0.1) for _ in range(COMMANDS)))
            )
        finally:
            await client.aclose()

    assert asyncio.run(burst()) == [None] * COMMANDS
