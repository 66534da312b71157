"""Decayed request counts: the arithmetic (halving every half-life, continuous across an
epoch boundary) and the script that adds a batch of weights and keeps a pool's top K, on
real Redis."""

from __future__ import annotations

import pytest
from redis import Redis

from contracts.popularity import (
    ADD,
    EPOCH_S,
    HALF_LIFE_S,
    decayed,
    member,
    popularity_key,
    top,
    weight,
)


def test_a_count_halves_every_half_life_and_carries_over_an_epoch_boundary() -> None:
    epoch = 9_000
    t0 = epoch * EPOCH_S + 17.0
    sets = [(member("sha256:a", "a"), weight(t0, epoch) + weight(t0 - HALF_LIFE_S, epoch))]
    now = decayed(sets, [], t0, epoch)[member("sha256:a", "a")]
    assert now == pytest.approx(1.5)  # one new request, one a half-life old
    later = decayed(sets, [], t0 + HALF_LIFE_S, epoch)[member("sha256:a", "a")]
    assert later == pytest.approx(0.75)
    # In the next epoch the set is the previous one: the same count, continuously.
    t1 = (epoch + 1) * EPOCH_S + 3.0
    carried = decayed([], sets, t1, epoch + 1)[member("sha256:a", "a")]
    assert carried == pytest.approx(1.5 * 2 ** (-(t1 - t0) / HALF_LIFE_S))
    assert weight(epoch * EPOCH_S + EPOCH_S - 1e-6, epoch) < 2**8


def test_top_sums_a_digests_aliases_and_ranks_by_count() -> None:
    counts = {
        member("sha256:a", "extract-r7"): 3.0,
        member("sha256:a", "extract"): 2.0,
        member("sha256:b", "classify"): 4.0,
        member("sha256:c", "rare"): 0.5,
    }
    assert top(counts, 2) == [("sha256:a", "extract-r7", 5.0), ("sha256:b", "classify", 4.0)]


def test_the_add_script_keeps_the_top_k_with_an_expiry(redis: Redis) -> None:
    key = popularity_key("test-pool", 1)
    redis.delete(key)
    add = redis.register_script(ADD)
    add(keys=[key], args=[3, 60, "d1 a", 5, "d2 b", 1, "d3 c", 3, "d4 d", 4])
    add(keys=[key], args=[3, 60, "d2 b", 10])  # a rising adapter displaces the smallest
    assert redis.zrevrange(key, 0, -1, withscores=True) == [
        ("d2 b", 10.0),
        ("d1 a", 5.0),
        ("d4 d", 4.0),
    ]
    assert 0 < redis.ttl(key) <= 60
    redis.delete(key)
