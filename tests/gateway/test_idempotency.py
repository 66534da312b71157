"""An ``Idempotency-Key`` reservation is let go only by the request that holds it."""

from __future__ import annotations

import asyncio

from redis import Redis
from redis.asyncio import Redis as AsyncRedis

from contracts.keys import idempotency_key
from gateway.idempotency import IdempotencyKeys
from lorafleet.stack import LocalStack


def test_a_late_release_does_not_free_a_later_requests_key(infra: LocalStack, redis: Redis) -> None:
    """Request A's reservation lapsed (its admission was cut short and its withdrawal took
    longer than the pending TTL); request B then reserved the key and admitted its job. A's
    late release, or late mark of its own job as done, leaves B's reservation: freeing it
    would let a third retry admit the same request a second time, overwriting it would answer
    B's retries with A's job."""

    async def go() -> tuple[bool, bool]:
        client = AsyncRedis.from_url(infra.redis_url, decode_responses=True)
        try:
            a = IdempotencyKeys(client, "t-idem", "order-1", ttl_s=600)
            b = IdempotencyKeys(client, "t-idem", "order-1", ttl_s=600)
            assert (await a.reserve("fp", "job-a")).owned
            await client.delete(idempotency_key("t-idem", "order-1"))  # A's lapsed
            assert (await b.reserve("fp", "job-b")).owned
            await b.done("fp", "job-b")
            await a.done("fp", "job-a")  # late: its admission went through after all
            await a.release("job-a")  # late
            kept = (await b.reserve("fp", "job-c")).job_id == "job-b"
            await b.release("job-b")
            freed = (await a.reserve("fp", "job-d")).owned
            return kept, freed
        finally:
            await client.aclose()

    kept, freed = asyncio.run(go())
    assert kept  # the third request replays B's job
    assert freed  # B's own release lets go
    redis.delete(idempotency_key("t-idem", "order-1"))


def test_a_request_that_reserves_its_key_again_for_its_own_job_holds_it(
    infra: LocalStack, redis: Redis
) -> None:
    """A request whose recalled access changed at its admission releases its reservation and
    reserves again for the same job id; if that release was lost (Redis refused it), its
    second reservation finds its own pending entry. It is the request's own (a job id is
    minted per request), so it holds it: waiting on it would wait for itself until its bound
    ran out (a 503 for a request that could be admitted)."""

    async def go() -> tuple[bool, bool]:
        client = AsyncRedis.from_url(infra.redis_url, decode_responses=True)
        try:
            a = IdempotencyKeys(client, "t-idem", "order-2", ttl_s=600)
            assert (await a.reserve("fp", "job-a")).owned
            async with asyncio.timeout(5):
                again = await a.reserve("fp", "job-a")
            other = IdempotencyKeys(client, "t-idem", "order-2", ttl_s=600)
            await a.done("fp", "job-a")
            replayed = await other.reserve("fp", "job-b")
            return again.owned, not replayed.owned and replayed.job_id == "job-a"
        finally:
            await client.aclose()

    try:
        owned, replayed = asyncio.run(go())
    finally:
        redis.delete(idempotency_key("t-idem", "order-2"))
    assert owned
    assert replayed  # once done, another request with the key replays the job
