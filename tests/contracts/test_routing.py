"""The routing policy (pure), and the hand-back script run by a real Redis."""

from __future__ import annotations

import json
import time
import uuid
from collections import Counter
from datetime import UTC, datetime

from redis import Redis

from contracts import admission, routing
from contracts.job_records import CLAIM, claim_call
from contracts.jobs import JobMessage, Routed, Sampling
from contracts.keys import WORKER_QUEUES, job_key, routed_key, worker_key
from contracts.queues import UNROUTABLE_QUEUE, Tier, queue_for
from contracts.registry import BaseModelRef
from contracts.routing import Decision, Level, Policy, WorkerState, choose
from contracts.task_messages import accepted_at
from gateway.queue import job_message
from gateway.routing import destination, predates_routing, worker_state
from tests.helpers import new_job
from worker.reaper import QueueKeeper, hand_back

BASE = "sha256:" + "b" * 64
OTHER_BASE = "sha256:" + "c" * 64
HOT = queue_for(Tier.HOT, BASE)
POLICY = Policy(max_copies=2, overload_ratio=1.0)


def _worker(
    name: str,
    adapters: dict[str, Level] | None = None,
    outstanding: int = 0,
    base: str = BASE,
    concurrency: int = 8,
) -> WorkerState:
    return WorkerState(
        slots=4,
        worker_id=name,
        base_model=base,
        queues=frozenset(queue_for(tier, base) for tier in Tier),
        concurrency=concurrency,
        outstanding=outstanding,
        adapters=adapters or {},
    )


def _digest(i: int) -> str:
    return f"sha256:{i:064x}"


def test_a_job_goes_to_the_least_loaded_worker_holding_its_adapter_at_the_best_level() -> None:
    d = _digest(1)
    fleet = [
        _worker("w1", {d: Level.DISK}, outstanding=0),
        _worker("w2", {d: Level.ENGINE}, outstanding=5),
        _worker("w3", {d: Level.ENGINE}, outstanding=2),
        _worker("w4", {}, outstanding=0),
    ]
    route = choose(fleet, BASE, HOT, d, POLICY)
    assert (route.decision, route.worker_id) == (Decision.RESIDENT, "w3")
    pinned = [*fleet, _worker("w5", {d: Level.PINNED}, outstanding=7)]
    assert choose(pinned, BASE, HOT, d, POLICY).worker_id == "w5"


def test_first_misses_for_one_adapter_land_on_one_worker_and_spread_across_adapters() -> None:
    fleet = [_worker(f"w{i}") for i in range(8)]
    chosen: Counter[str] = Counter()
    for i in range(400):
        routes = {choose(fleet, BASE, HOT, _digest(i), POLICY).worker_id for _ in range(3)}
        assert len(routes) == 1  # the same answer every time (and on every gateway)
        chosen[routes.pop() or ""] += 1
    assert set(chosen) == {f"w{i}" for i in range(8)}
    assert max(chosen.values()) < 3 * 400 / 8, chosen  # no worker takes most of them
    # A worker joining moves only the adapters it now ranks first for.
    grown = [*fleet, _worker("w8")]
    moved = [
        i
        for i in range(400)
        if choose(grown, BASE, HOT, _digest(i), POLICY).worker_id
        != choose(fleet, BASE, HOT, _digest(i), POLICY).worker_id
    ]
    assert all(choose(grown, BASE, HOT, _digest(i), POLICY).worker_id == "w8" for i in moved)
    assert 0 < len(moved) < 400 / 4


def test_a_new_copy_is_placed_only_when_every_holder_is_overloaded_and_never_past_the_cap() -> None:
    d = _digest(2)
    busy = [_worker("w1", {d: Level.ENGINE}, outstanding=8), _worker("w2"), _worker("w3")]
    placed = choose(busy, BASE, HOT, d, POLICY)
    assert placed.decision == Decision.PLACED and placed.worker_id in {"w2", "w3"}
    assert placed.worker_id == max(("w2", "w3"), key=lambda name: routing.rendezvous_score(d, name))
    at_cap = [
        _worker("w1", {d: Level.ENGINE}, outstanding=8),
        _worker("w2", {d: Level.DISK}, outstanding=9),
        _worker("w3"),
    ]
    assert choose(at_cap, BASE, HOT, d, POLICY) == routing.SHARED
    # What this gateway routed since its last read counts toward a worker's load.
    fresh = [_worker("w1", {d: Level.ENGINE}, outstanding=0), _worker("w2"), _worker("w3")]
    assert choose(fresh, BASE, HOT, d, POLICY, {"w1": 7}).worker_id == "w1"
    assert choose(fresh, BASE, HOT, d, POLICY, {"w1": 8}).decision == Decision.PLACED


def test_a_copy_being_made_on_a_worker_missing_from_the_view_still_counts_against_the_cap() -> None:
    d = _digest(5)
    # w1 holds the adapter and is overloaded; this gateway placed a copy on w9, whose
    # announcement is late (it is not in this view): that copy is the cap's second.
    fleet = [_worker("w1", {d: Level.ENGINE}, outstanding=8), _worker("w2"), _worker("w3")]
    assert choose(fleet, BASE, HOT, d, POLICY).decision == Decision.PLACED
    assert choose(fleet, BASE, HOT, d, POLICY, placing=("w9",)) == routing.SHARED
    # A placement the view shows as held is not counted twice.
    held = [*fleet, _worker("w9", {d: Level.DISK}, outstanding=9)]
    assert choose(held, BASE, HOT, d, POLICY, placing=("w9",)) == routing.SHARED
    roomy = Policy(max_copies=3, overload_ratio=1.0)
    assert choose(held, BASE, HOT, d, roomy, placing=("w9",)).decision == Decision.PLACED


def test_a_first_miss_goes_to_the_less_busy_of_its_two_first_ranked_workers() -> None:
    d = _digest(4)
    names = sorted((f"w{i}" for i in range(6)), key=lambda n: -routing.rendezvous_score(d, n))
    first, second = names[0], names[1]
    full = {_digest(100 + i): Level.ENGINE for i in range(4)}
    fleet = [_worker(name, full if name == first else {}) for name in names]
    assert choose(fleet, BASE, HOT, d, POLICY).worker_id == second
    busy = [_worker(name, {}, outstanding=4 if name == second else 0) for name in names]
    assert choose(busy, BASE, HOT, d, POLICY).worker_id == first


def test_only_workers_of_the_base_model_and_tier_are_routed_to() -> None:
    d = _digest(3)
    cold_only = WorkerState(
        worker_id="cold",
        base_model=BASE,
        queues=frozenset({queue_for(Tier.COLD, BASE)}),
        concurrency=8,
        outstanding=0,
        adapters={d: Level.PINNED},
    )
    other = _worker("other", {d: Level.PINNED}, base=OTHER_BASE)
    ours = [_worker("a"), _worker("b")]
    route = choose([cold_only, other, *ours], BASE, HOT, d, POLICY)
    assert route.decision == Decision.PLACED and route.worker_id in {"a", "b"}
    # No worker of the pool: the shared queue.
    assert choose([cold_only, other], BASE, HOT, d, POLICY) == routing.SHARED
    # A pool of one worker: the pool queue reaches it alone, nothing to route; a worker of
    # another base model beside it changes nothing (it never takes from this pool's queue).
    assert choose([ours[0]], BASE, HOT, d, POLICY) == routing.SHARED
    assert choose([ours[0], other], BASE, HOT, d, POLICY) == routing.SHARED
    assert queue_for(Tier.HOT, OTHER_BASE) in other.queues and HOT not in other.queues


def test_an_announcement_routing_must_not_use_is_skipped() -> None:
    record = {
        "worker_id": "h:1:x",
        "state": "serving",
        "queue": routing.worker_queue("h:1:x"),
        "base_model": {"id": "m", "digest": BASE},
        "queues": [HOT],
        "concurrency": 4,
        "jobs_running": 3,
        "adapters": {_digest(1): "engine", _digest(2): "disk", _digest(3): "unheard-of"},
    }
    now = time.time()
    state = worker_state({**record, "seen_at": now - 1}, 2, now, 5)
    assert state is not None
    assert state.outstanding == 5
    assert state.adapters == {_digest(1): Level.ENGINE, _digest(2): Level.DISK}
    assert worker_state({**record, "seen_at": now, "state": "draining"}, 0, now, 5) is None
    # Silent for longer than a living worker ever is (killed; its record not expired yet).
    assert worker_state({**record, "seen_at": now - 6}, 0, now, 5) is None
    old = {k: v for k, v in record.items() if k != "queue"}
    assert worker_state({**old, "seen_at": now}, 0, now, 5) is None
    assert predates_routing(old) and not predates_routing(record)


def _message(
    job_id: str, tier: Tier, accepted: float, worker: str | None, base: str = BASE
) -> JobMessage:
    return JobMessage(
        job_id=job_id,
        tenant="t",
        adapter="a",
        revision=_digest(9),
        base_model=BaseModelRef(id="m", digest=base),
        tier=tier,
        prompt="hi",
        sampling=Sampling(),
        accepted_at=accepted,
        deadline_at=accepted + 60,
        routed=None if worker is None else Routed(decision="resident", worker=worker),
    )


def _push(redis: Redis, message: JobMessage) -> None:
    redis.lpush(destination(message), job_message(message))


def _ids(redis: Redis, queue: str) -> list[str]:
    """Job ids of ``queue`` in the order consumers take them (right end first)."""
    raws: list[str] = redis.lrange(queue, 0, -1)  # type: ignore[assignment]
    return [json.loads(raw)["headers"]["id"] if raw.startswith("{") else raw for raw in raws][::-1]


def test_hand_back_moves_every_job_to_its_own_pool_queue_oldest_first(redis: Redis) -> None:
    worker = f"h:2:{time.time_ns()}"
    mine = routing.worker_queue(worker)
    hot, cold = queue_for(Tier.HOT, BASE), queue_for(Tier.COLD, BASE)
    other_hot = queue_for(Tier.HOT, OTHER_BASE)
    redis.delete(hot, cold, other_hot, UNROUTABLE_QUEUE)
    now = time.time()
    for i, tier in enumerate([Tier.HOT, Tier.COLD, Tier.HOT, Tier.HOT]):
        _push(redis, _message(f"r{i}", tier, now + i, worker))
    redis.lpush(mine, job_message(_message("r4", Tier.HOT, now + 4, worker, OTHER_BASE)))
    redis.lpush(hot, job_message(_message("queued-before", Tier.HOT, now - 1, None)))
    redis.lpush(mine, "not a job message")  # kept where an operator finds it, never lost
    try:
        assert hand_back(redis, worker, limit=2) == 2
        # Taken before what waited in the shared queue: they were admitted to be run first.
        assert _ids(redis, hot) == ["r0", "queued-before"] and _ids(redis, cold) == ["r1"]
        assert hand_back(redis, worker) == 4
        assert redis.llen(mine) == 0
        assert _ids(redis, hot) == ["r2", "r3", "r0", "queued-before"]
        # each message to the pool queue of its own base model
        assert _ids(redis, other_hot) == ["r4"]
        assert _ids(redis, UNROUTABLE_QUEUE) == ["not a job message"]
    finally:
        redis.delete(hot, cold, mine, other_hot, UNROUTABLE_QUEUE)


def test_the_queue_keeper_hands_back_a_gone_workers_queue_and_a_live_ones_stale_jobs(
    redis: Redis,
) -> None:
    hot = queue_for(Tier.HOT, BASE)
    gone, live = f"h:3:{time.time_ns()}", f"h:4:{time.time_ns()}"
    now = time.time()
    redis.delete(hot)
    redis.zadd(WORKER_QUEUES, {gone: now, live: now})
    redis.set(worker_key(live), json.dumps({"worker_id": live, "state": "serving"}), ex=60)
    _push(redis, _message("of-gone", Tier.HOT, now, gone))
    _push(redis, _message("stale", Tier.HOT, now - 30, live))
    _push(redis, _message("fresh", Tier.HOT, now, live))
    try:
        keeper = QueueKeeper(redis, interval_s=1, max_wait_s=10)
        assert keeper.sweep() == 2
        assert sorted(_ids(redis, hot)) == ["of-gone", "stale"]
        assert _ids(redis, routing.worker_queue(live)) == ["fresh"]
        assert keeper.sweep() == 0
        # A gone worker's empty queue stops being watched once it is long gone.
        redis.zadd(WORKER_QUEUES, {gone: now - 1000})
        keeper.sweep()
        assert redis.zscore(WORKER_QUEUES, gone) is None
        assert redis.zscore(WORKER_QUEUES, live) is not None
        assert all(accepted_at(raw) for raw in redis.lrange(hot, 0, -1))  # type: ignore[union-attr]
    finally:
        redis.zrem(WORKER_QUEUES, gone, live)
        redis.delete(hot, worker_key(live), routing.worker_queue(live), routing.worker_queue(gone))


def _admit_routed(redis: Redis, worker: str, accepted: float) -> tuple[JobMessage, str]:
    """Admit a job routed to ``worker`` through the real ``ADMIT``, message pushed inline."""
    tenant = f"t-{uuid.uuid4().hex[:8]}"
    message = _message(uuid.uuid4().hex, Tier.HOT, accepted, worker)
    message = message.model_copy(update={"tenant": tenant})
    job = new_job(id=message.job_id, tenant=tenant)
    encoded = job_message(message)
    keys, args = admission.admit_call(
        job,
        accepted + 120,
        admission.Limits(tier_max=10_000, tenant_max=100, rate_per_s=1000.0, burst=1000),
        60,
        message=encoded,
        queue=destination(message),
        routed=(worker, encoded),
    )
    verdict = admission.verdict(redis.register_script(admission.ADMIT)(keys=keys, args=args))
    assert verdict.refusal is None
    return message, encoded


def test_a_routed_jobs_message_is_kept_until_a_worker_receives_it(redis: Redis) -> None:
    worker, runner = f"h:5:{time.time_ns()}", f"h:6:{time.time_ns()}"
    message, encoded = _admit_routed(redis, worker, time.time())
    assert redis.hget(job_key(message.job_id), "message") == encoded
    assert redis.zscore(routed_key(worker), message.job_id) is not None
    keys, args = claim_call(
        message.job_id, runner, datetime.now(tz=UTC), 3, False, 30, 60, routed_to=worker
    )
    assert redis.register_script(CLAIM)(keys=keys, args=args)[0] == "run"
    assert redis.hget(job_key(message.job_id), "message") is None
    assert redis.zscore(routed_key(worker), message.job_id) is None
    redis.delete(routing.worker_queue(worker), job_key(message.job_id))


def test_a_gone_workers_routed_jobs_that_nobody_received_are_pushed_again(redis: Redis) -> None:
    """A worker killed while blocked on its queue takes the next message pushed there with it
    (the reply to its BRPOP lands in a dead socket: seen in tests/integration/
    test_fleet_routing.py). Its queue keeper pushes such jobs' kept messages again."""
    hot = queue_for(Tier.HOT, BASE)
    dead = f"h:7:{time.time_ns()}"
    now = time.time()
    lost, _ = _admit_routed(redis, dead, now)
    waiting, _ = _admit_routed(redis, dead, now + 1)
    ran, ran_message = _admit_routed(redis, dead, now + 2)
    redis.delete(hot)
    try:
        # The dead worker's BRPOP took the oldest (right end): it is in no list any more.
        assert _ids(redis, routing.worker_queue(dead))[0] == lost.job_id
        redis.rpop(routing.worker_queue(dead))
        # Another worker ran one (its claim releases the kept message).
        redis.lrem(routing.worker_queue(dead), 1, ran_message)
        keys, args = claim_call(
            ran.job_id, "other", datetime.now(tz=UTC), 3, False, 30, 60, "", dead
        )
        redis.register_script(CLAIM)(keys=keys, args=args)
        redis.zadd(WORKER_QUEUES, {dead: now})
        moved = QueueKeeper(redis, interval_s=1, max_wait_s=10).sweep()
        # The waiting one handed back from the queue, the lost one pushed again; not the one
        # that ran.
        assert moved == 2
        assert sorted(_ids(redis, hot)) == sorted([lost.job_id, waiting.job_id])
        assert redis.exists(routed_key(dead)) == 0
        assert redis.hget(job_key(lost.job_id), "message") is None
        assert QueueKeeper(redis, interval_s=1, max_wait_s=10).sweep() == 0
    finally:
        redis.zrem(WORKER_QUEUES, dead)
        redis.delete(hot, routing.worker_queue(dead), routed_key(dead))
        for job in (lost, waiting, ran):
            redis.delete(job_key(job.job_id))
