"""Decayed request counts per adapter revision and pool, kept by the gateways at admission and
read by the workers to prefetch what their pool is likely to be asked for next.

A count decays with a half-life of ``HALF_LIFE_S``. Instead of decaying every entry, each
request adds a weight that grows with time, ``2 ** ((t - epoch start) / HALF_LIFE_S)``, to a
sorted set of its pool and epoch (``EPOCH_S`` long, so a weight stays below 2**8); comparing
scores then compares decayed counts. A reader adds the previous epoch's set scaled by
``2 ** -(EPOCH_S / HALF_LIFE_S)``: what is older than that has decayed to under 1/256 of
its weight and is dropped with its set (each set expires after two epochs). Each set keeps
the ``top_k`` largest entries; the rest are dropped at every write (bounded: a pool's key
space never grows with its number of adapters).

Members are ``<revision digest> <alias>`` (the alias names the adapter in the engine).
"""

from __future__ import annotations

from contracts.keys import PREFIX

HALF_LIFE_S = 300.0
EPOCH_S = 8 * HALF_LIFE_S
KEY_TTL_S = int(2 * EPOCH_S + 60)


def epoch_of(now: float) -> int:
    return int(now // EPOCH_S)


def popularity_key(pool: str, epoch: int) -> str:
    """The sorted set of ``pool``'s decayed counts in ``epoch``."""
    return f"{PREFIX}:popularity:{pool}:{epoch}"


def weight(now: float, epoch: int) -> float:
    """What one request at ``now`` adds in ``epoch``'s set."""
    return 2.0 ** ((now - epoch * EPOCH_S) / HALF_LIFE_S)


def member(digest: str, alias: str) -> str:
    return f"{digest} {alias}"


def split(entry: str) -> tuple[str, str]:
    """``(digest, alias)`` of a member."""
    digest, _, alias = entry.partition(" ")
    return digest, alias


def decayed(
    current: list[tuple[str, float]], previous: list[tuple[str, float]], now: float, epoch: int
) -> dict[str, float]:
    """Member -> its decayed request count at ``now`` (requests, each worth 1 when new), from
    the sets of ``epoch`` and of the one before."""
    scale = 2.0 ** (-(now - epoch * EPOCH_S) / HALF_LIFE_S)
    counts: dict[str, float] = {}
    for entry, score in previous:
        counts[entry] = counts.get(entry, 0.0) + score * scale * 2.0 ** -(EPOCH_S / HALF_LIFE_S)
    for entry, score in current:
        counts[entry] = counts.get(entry, 0.0) + score * scale
    return counts


ADD = """
-- KEYS[1]: a pool's set for the epoch. ARGV: 1 top k, 2 ttl, then (member, weight) pairs.
for i = 3, #ARGV, 2 do redis.call('ZINCRBY', KEYS[1], ARGV[i + 1], ARGV[i]) end
local k = tonumber(ARGV[1])
if redis.call('ZCARD', KEYS[1]) > k then redis.call('ZREMRANGEBYRANK', KEYS[1], 0, -(k + 1)) end
redis.call('EXPIRE', KEYS[1], ARGV[2])
return 1
"""
"""Add the weights of a batch of requests to one set and keep its top ``k``."""


def top(counts: dict[str, float], n: int) -> list[tuple[str, str, float]]:
    """The ``n`` digests asked for most: ``(digest, alias, decayed count)``, the counts of
    a digest's aliases summed (its alias: the one asked for most)."""
    total: dict[str, float] = {}
    named: dict[str, tuple[float, str]] = {}
    for entry, count in counts.items():
        digest, alias = split(entry)
        total[digest] = total.get(digest, 0.0) + count
        if digest not in named or named[digest][0] < count:
            named[digest] = (count, alias)
    ranked = sorted(total, key=lambda digest: -total[digest])[:n]
    return [(digest, named[digest][1], total[digest]) for digest in ranked]
