"""Nothing stays admitted forever: a job whose message never reached a worker ends
``deadline_exceeded`` soon after its deadline, with every effect an outcome has: its
admission slots freed, its webhook called once, its batch completed."""

from __future__ import annotations

import time
import uuid
from datetime import UTC, datetime

import httpx
from redis import Redis

from contracts import admission
from contracts.batches import BatchLine, BatchRecord
from contracts.jobs import JobPublic, JobStatus
from contracts.keys import DEADLINES, job_key, queue_ledger_key, tenant_ledger_key
from contracts.queues import queue_for
from contracts.registry import AdapterRecord
from contracts.webhooks import WebhookTarget, batch_event_id, job_event_id
from lorafleet.stack import DEV_TENANT
from tests.helpers import hot_alias, job_when
from tests.receiver import receiving

DEADLINE_S = 2.0
LIMITS = admission.Limits(tier_max=10_000, tenant_max=10_000, rate_per_s=1000.0, burst=1000)


def _job(record: AdapterRecord, deadline_at: float, **fields: object) -> JobPublic:
    now = time.time()
    return JobPublic(
        id=uuid.uuid4().hex,
        status=JobStatus.QUEUED,
        tenant=DEV_TENANT,
        adapter=record.alias,
        revision=record.digest,
        tier=record.tier,
        queue=queue_for(record.tier, record.base_model.digest),
        created_at=datetime.fromtimestamp(now, tz=UTC),
        deadline_at=datetime.fromtimestamp(deadline_at, tz=UTC),
        **fields,  # type: ignore[arg-type]
    )


def test_jobs_admitted_but_never_enqueued_end_at_their_deadline(
    api: httpx.Client, redis: Redis, published: dict[str, AdapterRecord]
) -> None:
    """What a gateway that died between its admission script and its publish leaves behind:
    records and ledger entries, a batch, and no message for any worker to run."""
    record = published[hot_alias(published)]
    deadline_at = time.time() + DEADLINE_S
    expires_at = deadline_at + admission.LEDGER_GRACE_S
    with receiving() as receiver:
        target = WebhookTarget(url=receiver.url())
        single = _job(record, deadline_at, webhook=target)
        keys, args = admission.admit_call(single, expires_at, LIMITS, 3600)
        reply = redis.register_script(admission.ADMIT)(keys=keys, args=args)
        assert admission.verdict(reply).refusal is None
        batch_id = "batch_" + uuid.uuid4().hex
        batched = [_job(record, deadline_at, batch=batch_id) for _ in range(2)]
        batch = BatchRecord(
            id=batch_id,
            tenant=DEV_TENANT,
            endpoint="/v1/jobs",
            created_at=int(time.time()),
            expires_at=int(deadline_at),
            webhook=target,
        )
        lines = [
            BatchLine(custom_id=f"r{n}", job_id=job.id, endpoint="/v1/jobs", model=record.alias)
            for n, job in enumerate(batched)
        ]
        limits = admission.BatchLimits(
            tenant_max=LIMITS.tenant_max,
            rate_per_s=LIMITS.rate_per_s,
            burst=LIMITS.burst,
            tier_max=dict.fromkeys(admission.TIER_ORDER, LIMITS.tier_max),
        )
        keys, args = admission.admit_batch_call(batch, batched, lines, expires_at, limits, 3600)
        reply = redis.register_script(admission.ADMIT_BATCH)(keys=keys, args=args)
        assert admission.batch_verdict(reply, batched)[0].refusal is None

        # First in the index: a record this version cannot read (written by hand, or by
        # another version). It must not stop the sweeps of the jobs behind it.
        unreadable = uuid.uuid4().hex
        redis.hset(job_key(unreadable), "record", '{"id": "' + unreadable + '", "status": 7}')
        redis.expire(job_key(unreadable), 600)
        redis.zadd(DEADLINES, {unreadable: deadline_at - 1})

        jobs = [single, *batched]
        for job in jobs:
            ended = job_when(redis, job.id, lambda j: j.status.terminal, timeout_s=60)
            assert ended.status == "failed", ended.model_dump_json()
            assert ended.error is not None and ended.error.code == "deadline_exceeded"
            assert f"waited in the queue ({job.queue}) and never started" in ended.error.message
            assert ended.attempts == 0
        completed = api.get(f"/v1/batches/{batch_id}").json()
        assert completed["status"] == "completed"
        assert completed["counts"]["failed"] == 2
        receiver.wait_for(job_event_id(single.id))
        receiver.wait_for(batch_event_id(batch_id))
        time.sleep(2)  # a second sweep or a second call would show by now
        assert len(receiver.calls_for(job_event_id(single.id))) == 1
        assert len(receiver.calls_for(batch_event_id(batch_id))) == 1
    for key in (queue_ledger_key(single.queue), tenant_ledger_key(DEV_TENANT), DEADLINES):
        assert not {job.id for job in jobs} & set(redis.zrange(key, 0, -1))  # type: ignore[arg-type]
    assert redis.zscore(DEADLINES, unreadable) is None  # dropped from the index, logged
