"""The admission ledger scripts, run by a real Redis (the session's Valkey)."""

from __future__ import annotations

import json
import time
import uuid
from collections.abc import Iterator
from datetime import UTC, datetime

import pytest
from redis import Redis

from contracts import admission
from contracts.batches import BatchLine, BatchRecord
from contracts.job_records import (
    ADVANCE,
    CLAIM,
    WITHDRAWN,
    WITHDRAWN_TTL_S,
    Advance,
    advance_call,
    claim_call,
)
from contracts.jobs import JobPublic, JobStatus
from contracts.keys import (
    DEADLINES,
    RETIRED_INDEX,
    STREAM_OPENED,
    STREAM_OPENED_ID,
    adapter_key,
    api_key_key,
    batch_jobs_key,
    batch_key,
    channel_key,
    grants_key,
    job_key,
    queue_ledger_key,
    rate_key,
    stream_key,
    tenant_key,
    tenant_ledger_key,
)
from contracts.queues import Tier, queue_for
from gateway.access import ACCESS

LIMITS = admission.Limits(tier_max=100, tenant_max=2, rate_per_s=1000.0, burst=1000)


BASE = "sha256:" + "b" * 64
OTHER_BASE = "sha256:" + "c" * 64


def _job(tenant: str, base: str = BASE) -> JobPublic:
    return JobPublic(
        id=uuid.uuid4().hex,
        status=JobStatus.QUEUED,
        tenant=tenant,
        adapter="a",
        revision="sha256:" + "0" * 64,
        tier=Tier.WARM,
        queue=queue_for(Tier.WARM, base),
        created_at=datetime.now(tz=UTC),
    )


def _admit(redis: Redis, job: JobPublic, expires_at: float) -> admission.Verdict:
    keys, args = admission.admit_call(job, expires_at, LIMITS, 60)
    return admission.verdict(redis.register_script(admission.ADMIT)(keys=keys, args=args))


def _held(redis: Redis, tenant: str) -> int:
    return int(redis.zcard(tenant_ledger_key(tenant)))  # type: ignore[arg-type]


def test_terminal_write_releases_once_and_the_count_never_goes_negative(redis: Redis) -> None:
    tenant = f"t-{uuid.uuid4().hex[:8]}"
    first, second = _job(tenant), _job(tenant)
    assert _admit(redis, first, time.time() + 60).refusal is None
    assert _admit(redis, second, time.time() + 60).refusal is None
    assert _admit(redis, _job(tenant), time.time() + 60).refusal == admission.Refusal.TENANT
    assert redis.hget(job_key(first.id), "status") == "queued"

    done = first.model_copy(update={"status": JobStatus.SUCCEEDED})
    for _ in range(3):  # redelivered outcomes: only the first is written, released once
        keys, args = advance_call(done, 60)
        redis.register_script(ADVANCE)(keys=keys, args=args)
    assert _held(redis, tenant) == 1
    keys, args = admission.withdraw_call(first, LIMITS.burst)
    redis.register_script(admission.WITHDRAW)(keys=keys, args=args)
    assert _held(redis, tenant) == 1  # withdrawing a finished job releases nothing more
    assert redis.zscore(queue_ledger_key(second.queue), second.id) is not None


def test_an_entry_past_its_expiry_stops_counting(redis: Redis) -> None:
    tenant = f"t-{uuid.uuid4().hex[:8]}"
    stale = [_job(tenant), _job(tenant)]
    for job in stale:  # jobs that will never finish (no worker, record expired...)
        assert _admit(redis, job, time.time() - 1).refusal is None
    assert _admit(redis, _job(tenant), time.time() + 60).refusal is None
    assert _held(redis, tenant) == 1


def test_withdraw_refunds_the_rate_token_once(redis: Redis) -> None:
    tenant = f"t-{uuid.uuid4().hex[:8]}"
    job = _job(tenant)
    assert _admit(redis, job, time.time() + 60).refusal is None
    spent = float(redis.hget(rate_key(tenant), "tokens"))  # type: ignore[arg-type]
    keys, args = admission.withdraw_call(job, LIMITS.burst)
    for _ in range(2):
        redis.register_script(admission.WITHDRAW)(keys=keys, args=args)
    refunded = float(redis.hget(rate_key(tenant), "tokens"))  # type: ignore[arg-type]
    assert refunded == spent + 1
    assert redis.hgetall(job_key(job.id)) == {"status": "withdrawn"}  # no record: a tombstone
    assert _held(redis, tenant) == 0


def test_a_streamed_job_is_admitted_with_its_stream_open_and_withdrawn_without_it(
    redis: Redis,
) -> None:
    """A job whose caller streams gets its stream in the admitting script (an opening entry,
    expiring with the record), so the terminal write always finds a stream to mark the end
    in; a withdrawal leaves no stream behind. A job whose caller does not stream gets none."""
    tenant = f"t-{uuid.uuid4().hex[:8]}"
    streamed, plain = _job(tenant), _job(tenant)
    keys, args = admission.admit_call(streamed, time.time() + 60, LIMITS, 60, stream=True)
    assert (
        admission.verdict(redis.register_script(admission.ADMIT)(keys=keys, args=args)).refusal
        is None
    )
    assert _admit(redis, plain, time.time() + 60).refusal is None
    assert redis.xrange(stream_key(streamed.id)) == [(STREAM_OPENED_ID, {STREAM_OPENED: "1"})]
    assert 0 < int(redis.ttl(stream_key(streamed.id))) <= 60  # type: ignore[arg-type]
    assert not redis.exists(stream_key(plain.id))

    keys, args = admission.withdraw_call(streamed, LIMITS.burst)
    assert redis.register_script(admission.WITHDRAW)(keys=keys, args=args) == 1
    assert not redis.exists(stream_key(streamed.id))
    assert redis.hgetall(job_key(streamed.id)) == {"status": "withdrawn"}


def test_an_admission_run_twice_admits_enqueues_and_spends_once(redis: Redis) -> None:
    """A client that retries the script after its reply was lost (redis-py retries a command
    once on a fresh connection) must not push the message twice or take a second token."""
    tenant = f"t-{uuid.uuid4().hex[:8]}"
    job = _job(tenant)
    queue = job.queue
    before = int(redis.llen(queue))  # type: ignore[arg-type]
    keys, args = admission.admit_call(job, time.time() + 60, LIMITS, 60, message="m")
    try:
        for _ in range(2):
            reply = redis.register_script(admission.ADMIT)(keys=keys, args=args)
            assert admission.verdict(reply).refusal is None
        assert int(redis.llen(queue)) == before + 1  # type: ignore[arg-type]
        assert float(redis.hget(rate_key(tenant), "tokens")) == LIMITS.burst - 1  # type: ignore[arg-type]
        assert _held(redis, tenant) == 1
    finally:
        redis.lrem(queue, 0, "m")


def test_an_admission_that_arrives_after_its_withdrawal_admits_and_enqueues_nothing(
    redis: Redis,
) -> None:
    """A reply lost to a timeout: the gateway withdraws on another connection, and the first
    connection's ADMIT, still waiting in Redis's input, runs after it. It must find the
    withdrawal and do nothing (before the tombstone it admitted and enqueued a job its caller
    had been answered 503 for)."""
    tenant = f"t-{uuid.uuid4().hex[:8]}"
    job = _job(tenant)
    queue = job.queue
    before = int(redis.llen(queue))  # type: ignore[arg-type]
    keys, args = admission.withdraw_call(job, LIMITS.burst)
    assert redis.register_script(admission.WITHDRAW)(keys=keys, args=args) == 0
    keys, args = admission.admit_call(job, time.time() + 60, LIMITS, 60, message="late")
    with pytest.raises(admission.AdmissionWithdrawn):
        admission.verdict(redis.register_script(admission.ADMIT)(keys=keys, args=args))
    assert int(redis.llen(queue)) == before  # type: ignore[arg-type]
    assert _held(redis, tenant) == 0
    assert not redis.exists(rate_key(tenant))  # no token taken
    assert redis.hget(job_key(job.id), "record") is None
    # Nothing claims or writes a withdrawn job.
    claim_keys, claim_args = claim_call(job.id, "w:1:a", datetime.now(tz=UTC), 3, False, 60, 60)
    assert redis.register_script(CLAIM)(keys=claim_keys, args=claim_args) == ["missing"]
    done = job.model_copy(update={"status": JobStatus.SUCCEEDED})
    keys, args = advance_call(done, 60)
    assert Advance(int(redis.register_script(ADVANCE)(keys=keys, args=args))) == Advance.MISSING
    assert 0 < int(redis.ttl(job_key(job.id))) <= WITHDRAWN_TTL_S  # type: ignore[arg-type]


def _batch(tenant: str, size: int) -> tuple[BatchRecord, list[JobPublic], list[BatchLine]]:
    """A batch of ``size`` jobs of ``tenant``, with its lines, not admitted yet."""
    jobs = [_job(tenant) for _ in range(size)]
    batch = BatchRecord(
        id=f"batch_{uuid.uuid4().hex}",
        tenant=tenant,
        endpoint="/v1/jobs",
        created_at=int(time.time()),
        expires_at=int(time.time() + 60),
    )
    lines = [
        BatchLine(custom_id=str(n), job_id=job.id, endpoint="/v1/jobs", model="a")
        for n, job in enumerate(jobs)
    ]
    return batch, jobs, lines


def test_a_batch_admission_that_arrives_after_its_withdrawal_admits_nothing(
    redis: Redis,
) -> None:
    tenant = f"t-{uuid.uuid4().hex[:8]}"
    batch, jobs, lines = _batch(tenant, 3)
    limits = admission.BatchLimits(
        tenant_max=10, rate_per_s=1000.0, burst=1000, tier_max=dict.fromkeys(Tier, 100)
    )
    keys, args = admission.withdraw_batch_call(batch, jobs, limits.burst)
    assert redis.register_script(admission.WITHDRAW_BATCH)(keys=keys, args=args) == 0
    keys, args = admission.admit_batch_call(
        batch, jobs, lines, time.time() + 60, limits, 60, messages=["m"] * 3
    )
    with pytest.raises(admission.AdmissionWithdrawn):
        admission.batch_verdict(
            redis.register_script(admission.ADMIT_BATCH)(keys=keys, args=args), jobs
        )
    assert _held(redis, tenant) == 0
    assert not any(redis.exists(job_key(job.id)) for job in jobs)


def test_a_withdrawn_batch_leaves_no_record_no_ledger_entry_and_its_token_back(
    redis: Redis,
) -> None:
    """Admitted (records, lines, ledger entries, messages pushed, one token), then withdrawn:
    every job key and the lines go, the ledger is empty, the token is refunded, and the
    batch's key is a tombstone. The messages stay in the queue: the worker finds no record
    for them and drops them."""
    tenant = f"t-{uuid.uuid4().hex[:8]}"
    batch, jobs, lines = _batch(tenant, 3)
    limits = admission.BatchLimits(
        tenant_max=10, rate_per_s=1000.0, burst=5, tier_max=dict.fromkeys(Tier, 100)
    )
    queue = jobs[0].queue
    before = int(redis.llen(queue))  # type: ignore[arg-type]
    messages = [f"m-{job.id}" for job in jobs]
    keys, args = admission.admit_batch_call(
        batch, jobs, lines, time.time() + 60, limits, 60, messages=messages
    )
    try:
        reply = redis.register_script(admission.ADMIT_BATCH)(keys=keys, args=args)
        assert admission.batch_verdict(reply, jobs)[0].refusal is None
        assert all(redis.hexists(job_key(job.id), "record") for job in jobs)
        assert _held(redis, tenant) == 3
        assert float(redis.hget(rate_key(tenant), "tokens")) == 4  # type: ignore[arg-type]
        assert int(redis.llen(queue)) == before + 3  # type: ignore[arg-type]
        keys, args = admission.withdraw_batch_call(batch, jobs, limits.burst)
        assert redis.register_script(admission.WITHDRAW_BATCH)(keys=keys, args=args) == 1
        assert not any(redis.exists(job_key(job.id)) for job in jobs)
        assert not redis.exists(batch_jobs_key(batch.id))
        assert _held(redis, tenant) == 0
        assert float(redis.hget(rate_key(tenant), "tokens")) == 5  # type: ignore[arg-type]
        assert redis.hgetall(batch_key(batch.id)) == {WITHDRAWN: "1"}
        # Withdrawn twice (the undo retried): nothing more is refunded.
        assert redis.register_script(admission.WITHDRAW_BATCH)(keys=keys, args=args) == 0
        assert float(redis.hget(rate_key(tenant), "tokens")) == 5  # type: ignore[arg-type]
    finally:
        for message in messages:
            redis.lrem(queue, 0, message)


def test_a_batch_over_two_base_models_counts_each_in_its_own_pool_queue(redis: Redis) -> None:
    """Each pool queue (a tier of one base model's pool) has its own ledger and limit: a batch
    whose jobs go to two pools is checked against both, refused whole if one is full (the
    reply names that queue), and admitted into both otherwise; withdrawn, both are empty."""
    tenant = f"t-{uuid.uuid4().hex[:8]}"
    batch, jobs, lines = _batch(tenant, 4)
    jobs[2:] = [_job(tenant, OTHER_BASE) for _ in range(2)]
    lines = [
        line.model_copy(update={"job_id": job.id}) for line, job in zip(lines, jobs, strict=True)
    ]
    ours, theirs = queue_ledger_key(jobs[0].queue), queue_ledger_key(jobs[2].queue)
    assert ours != theirs
    redis.delete(ours, theirs)
    # the other pool holds 9 of at most 10 already: its 2 more do not fit, ours would
    for n in range(9):
        redis.zadd(theirs, {f"held-{n}": time.time() + 60})
    tight = admission.BatchLimits(
        tenant_max=100, rate_per_s=1000.0, burst=1000, tier_max=dict.fromkeys(Tier, 10)
    )
    try:
        keys, args = admission.admit_batch_call(batch, jobs, lines, time.time() + 60, tight, 60)
        reply = redis.register_script(admission.ADMIT_BATCH)(keys=keys, args=args)
        verdict, full = admission.batch_verdict(reply, jobs)
        assert verdict.refusal == admission.Refusal.TIER and full == jobs[2].queue
        assert redis.zcard(ours) == 0 and redis.zcard(theirs) == 9  # nothing admitted
        assert not any(redis.exists(job_key(job.id)) for job in jobs)
        redis.delete(theirs)
        reply = redis.register_script(admission.ADMIT_BATCH)(keys=keys, args=args)
        assert admission.batch_verdict(reply, jobs)[0].refusal is None
        assert set(redis.zrange(ours, 0, -1)) == {jobs[0].id, jobs[1].id}  # type: ignore[arg-type]
        assert set(redis.zrange(theirs, 0, -1)) == {jobs[2].id, jobs[3].id}  # type: ignore[arg-type]
        keys, args = admission.withdraw_batch_call(batch, jobs, tight.burst)
        assert redis.register_script(admission.WITHDRAW_BATCH)(keys=keys, args=args) == 1
        assert redis.zcard(ours) == 0 and redis.zcard(theirs) == 0
        assert _held(redis, tenant) == 0
    finally:
        redis.delete(ours, theirs)


@pytest.fixture
def access_keys(redis: Redis) -> Iterator[tuple[str, str, str, str]]:
    """A key of a new tenant granted ``name``, a channel to an adapter's record (texts the
    scripts only compare, but the key's names its tenant); ``(tenant, key's key, name, alias)``.
    All of it removed afterwards from the shared Redis, with whatever its jobs left."""
    tenant, name, alias = (f"{what}-{uuid.uuid4().hex[:8]}" for what in ("t", "ch", "a"))
    key = api_key_key(uuid.uuid4().hex)
    redis.set(key, json.dumps({"tenant": tenant, "key_id": "k"}))
    redis.set(tenant_key(tenant), json.dumps({"name": tenant}))
    redis.sadd(grants_key(tenant), name)
    redis.set(channel_key(name), alias)
    redis.set(adapter_key(alias), json.dumps({"alias": alias}))
    yield tenant, key, name, alias
    for job_id in redis.zrange(tenant_ledger_key(tenant), 0, -1):
        redis.zrem(queue_ledger_key(queue_for(Tier.WARM, BASE)), job_id)
        redis.zrem(DEADLINES, job_id)
        redis.delete(job_key(job_id))
    redis.srem(RETIRED_INDEX, alias)
    redis.delete(
        key,
        tenant_key(tenant),
        grants_key(tenant),
        channel_key(name),
        adapter_key(alias),
        adapter_key(f"{alias}-moved"),
        tenant_ledger_key(tenant),
        rate_key(tenant),
    )


def _read_access(redis: Redis, key: str, name: str) -> admission.Recalled:
    script = redis.register_script(ACCESS)
    reply = script(keys=[key], args=[*admission.ACCESS_PREFIXES, name])
    assert len(reply) == admission.ACCESS_READS and reply[3] == 1 and reply[5] == 0, reply
    return admission.Recalled(key, name, admission.witness(reply))


def _admit_recalled(redis: Redis, job: JobPublic, recalled: admission.Recalled) -> None:
    keys, args = admission.admit_call(job, time.time() + 3600, LIMITS, 60, recalled=recalled)
    admission.verdict(redis.register_script(admission.ADMIT)(keys=keys, args=args))


def test_a_recalled_access_is_admitted_only_while_every_value_read_is_unchanged(
    redis: Redis, access_keys: tuple[str, str, str, str]
) -> None:
    tenant, key, name, _ = access_keys
    recalled = _read_access(redis, key, name)
    for at in range(admission.ACCESS_READS):
        for other in ("", "=other"):
            witness = list(recalled.witness)
            witness[at] = other
            job = _job(tenant)
            with pytest.raises(admission.AccessChanged):
                _admit_recalled(redis, job, admission.Recalled(key, name, tuple(witness)))
            assert not redis.exists(job_key(job.id)), (at, other)
    assert _held(redis, tenant) == 0
    assert not redis.exists(rate_key(tenant))  # no token taken either
    job = _job(tenant)
    _admit_recalled(redis, job, recalled)
    assert redis.hget(job_key(job.id), "status") == "queued" and _held(redis, tenant) == 1


@pytest.mark.parametrize(
    "change",
    [
        "key revoked",
        "key rotated",
        "tenant record",
        "grant revoked",
        "channel moved",
        "adapter record",
        "alias retired",
    ],
)
def test_each_change_to_what_an_access_read_refuses_its_recalled_admission(
    redis: Redis, access_keys: tuple[str, str, str, str], change: str
) -> None:
    tenant, key, name, alias = access_keys
    recalled = _read_access(redis, key, name)
    if change == "key revoked":
        redis.delete(key)
    elif change == "key rotated":
        redis.set(key, json.dumps({"tenant": tenant, "key_id": "k", "expires_at": "soon"}))
    elif change == "tenant record":
        redis.set(tenant_key(tenant), json.dumps({"name": tenant, "limits": {"burst": 1}}))
    elif change == "grant revoked":
        redis.srem(grants_key(tenant), name)
    elif change == "channel moved":
        another = f"{alias}-moved"
        redis.set(channel_key(name), another)
        redis.set(adapter_key(another), json.dumps({"alias": alias}))  # the same text
    elif change == "adapter record":
        redis.set(adapter_key(alias), json.dumps({"alias": alias, "tier": "cold"}))
    else:
        redis.sadd(RETIRED_INDEX, alias)
    job = _job(tenant)
    with pytest.raises(admission.AccessChanged):
        _admit_recalled(redis, job, recalled)
    assert not redis.exists(job_key(job.id)) and _held(redis, tenant) == 0
