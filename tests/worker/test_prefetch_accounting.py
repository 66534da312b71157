"""The look-ahead's bookkeeping (pure logic: Redis, the engine and the disk cache are
stand-ins): a waiting job counts once in its adapter's request rate, and a prefetch that
reached no level is neither used nor wasted."""

from __future__ import annotations

from collections import Counter
from typing import Any

from prometheus_client import REGISTRY

from contracts.task_messages import task_message
from worker.prefetch import LOOKAHEAD, PROVEN_KEPT, Prefetcher

BASE = "sha256:" + "b" * 64
DIGEST = "sha256:" + "d" * 64


def _raw(job_id: str) -> str:
    job = {
        "job_id": job_id,
        "adapter": "tail",
        "revision": DIGEST,
        "base_model": {"id": "m", "digest": BASE},
    }
    return task_message("lorafleet.run_job", job_id, "q", [job], f"job {job_id}")


class Redis:
    """``pipeline().lrange(...).execute()``: the messages of the worker's own queue
    (``own``) and of a shared queue (``queue``)."""

    def __init__(self) -> None:
        self.own: list[str] = []
        self.queue: list[str] = []

    def pipeline(self, transaction: bool = False) -> Redis:
        return self

    def lrange(self, key: str, start: int, end: int) -> None:
        pass

    def execute(self) -> list[list[str]]:
        return [list(self.own), list(self.queue)]


class Cache:
    on_evict: Any = None

    def __init__(self) -> None:
        self.expected: Counter[str] = Counter()

    def expect(self, digest: str, requests: float = 1.0) -> None:
        self.expected[digest] += requests

    def has(self, digest: str) -> bool:
        return True  # on disk: nothing to fetch


class Adapters:
    on_proven: Any = None

    def engine_has_room(self) -> bool:
        return False  # nothing to register either


def _prefetcher(redis: Redis, cache: Cache) -> Prefetcher:
    return Prefetcher(
        redis,  # type: ignore[arg-type]
        Adapters(),  # type: ignore[arg-type]
        cache,  # type: ignore[arg-type]
        BASE,
        ["own", "shared"],
        lookahead_jobs=16,
        interval_s=60.0,
    )


def _wasted() -> float:
    value = REGISTRY.get_sample_value(
        "lorafleet_adapter_prefetches_total", {"trigger": LOOKAHEAD, "outcome": "wasted"}
    )
    return value or 0.0


def test_a_job_the_look_ahead_counted_while_it_waited_is_not_counted_again_by_its_fetch() -> None:
    redis, cache = Redis(), Cache()
    prefetcher = _prefetcher(redis, cache)
    redis.queue = [_raw("waits"), _raw("taken-at-once")]
    prefetcher._lookahead()
    redis.queue = [_raw("waits")]  # the other one was taken within the pass
    for _ in range(3):  # still waiting, pass after pass
        prefetcher._lookahead()
    assert cache.expected[DIGEST] == 1
    assert prefetcher.counted_ahead("waits")  # its own fetch does not count it
    assert not prefetcher.counted_ahead("waits")  # once
    assert not prefetcher.counted_ahead("taken-at-once")  # never seen waiting: its fetch counts


def test_a_registration_that_failed_leaves_nothing_to_call_wasted() -> None:
    prefetcher = _prefetcher(Redis(), Cache())
    before = _wasted()
    prefetcher._mark(DIGEST, "cpu", LOOKAHEAD, True)  # decided, then the load failed
    prefetcher._mark(DIGEST, "cpu", LOOKAHEAD, False)
    prefetcher._evicted(DIGEST)
    assert _wasted() == before
    assert not prefetcher.found(DIGEST, "disk")


def test_a_prefetched_download_nobody_used_is_wasted_though_its_registration_failed() -> None:
    prefetcher = _prefetcher(Redis(), Cache())
    before = _wasted()
    prefetcher._reached(DIGEST, "disk", LOOKAHEAD)
    prefetcher._mark(DIGEST, "cpu", LOOKAHEAD, True)
    prefetcher._mark(DIGEST, "cpu", LOOKAHEAD, False)
    prefetcher._evicted(DIGEST)
    assert _wasted() == before + 1


def test_a_job_in_the_workers_own_queue_is_waiting_at_first_sight() -> None:
    """Routing put it there: no other worker takes it, so its adapter is fetched at once; a
    shared queue's job only once it is still there at the next pass."""

    redis = Redis()
    prefetcher = _prefetcher(redis, Cache())
    redis.own, redis.queue = [_raw("routed-here")], [_raw("in-the-pool")]
    prefetcher._lookahead()
    assert prefetcher.counted_ahead("routed-here")
    assert not prefetcher.counted_ahead("in-the-pool")
    prefetcher._lookahead()
    assert prefetcher.counted_ahead("in-the-pool")


def test_a_job_that_joins_a_prefetchs_download_uses_it() -> None:
    prefetcher = _prefetcher(Redis(), Cache())
    before = _wasted()
    used = REGISTRY.get_sample_value(
        "lorafleet_adapter_prefetches_total", {"trigger": LOOKAHEAD, "outcome": "used"}
    )
    prefetcher._busy.add(DIGEST)  # downloading
    assert not prefetcher.found(DIGEST, "remote")  # it found it remote, and waits for it
    prefetcher._reached(DIGEST, "disk", LOOKAHEAD)
    prefetcher._mark(DIGEST, "cpu", LOOKAHEAD, True)  # the engine step, decided ...
    prefetcher._mark(DIGEST, "cpu", LOOKAHEAD, False)  # ... and the job's load got there first
    prefetcher._evicted(DIGEST)
    assert _wasted() == before
    after = REGISTRY.get_sample_value(
        "lorafleet_adapter_prefetches_total", {"trigger": LOOKAHEAD, "outcome": "used"}
    )
    assert (after or 0.0) == (used or 0.0) + 1


class ProvenRedis(Redis):
    """Also the fleet's set of digests proven on this engine version (``SISMEMBER``)."""

    def __init__(self) -> None:
        super().__init__()
        self.proven: set[str] = set()
        self.asked = 0

    def sismember(self, key: str, member: str) -> bool:
        self.asked += 1
        return member in self.proven


def test_the_proven_digests_kept_in_memory_are_bounded_and_the_rest_are_asked_of_redis() -> None:
    redis = ProvenRedis()
    prefetcher = _prefetcher(redis, Cache())
    digests = [f"sha256:{i:064x}" for i in range(PROVEN_KEPT + 50)]
    for digest in digests:
        prefetcher.proven(digest)
    redis.proven.update(digests)  # as the announcements wrote them
    assert len(prefetcher._proven) == PROVEN_KEPT
    assert prefetcher._is_proven(digests[-1]) and redis.asked == 0  # recent: from memory
    assert prefetcher._is_proven(digests[0]) and redis.asked == 1  # forgotten: Redis knows
    assert not prefetcher._is_proven("sha256:" + "e" * 64)
