"""The Redis traffic of one job, as each side sends it: what ``redis_capacity.py`` replays.

Written from the code at ``fcd311d`` (``benchmarks/REDIS_CLUSTER.md``, "What one job costs"),
round trip by round trip: authentication and adapter resolution, ``ADMIT`` (or
``ADMIT_BATCH``), the kombu publish, the worker's receipt, delivery record, claim, terminal
write and ack, and the caller's reads. The scripts and their arguments are the project's own
(``contracts.admission``, ``contracts.job_records``), so a change inside a script is replayed
as it is; a change in what the services send (fewer round trips, merged scripts) is made here.
``redis_capacity.py --cost-json`` lists, command by command, where this mix and the one
``redis_cost.py`` measured differ.
"""

from __future__ import annotations

import hashlib
import json
import time
import uuid
from dataclasses import dataclass
from datetime import UTC, datetime, timedelta
from typing import Any

from celery import Celery
from redis import Redis

from contracts import admission, job_records
from contracts.batches import BatchLine, BatchRecord
from contracts.jobs import (
    EngineInfo,
    JobMessage,
    JobPublic,
    JobResult,
    JobStatus,
    LoadTimings,
    ResultMetadata,
    Sampling,
    Usage,
)
from contracts.keys import (
    RETIRED_INDEX,
    adapter_key,
    api_key_key,
    batch_jobs_key,
    batch_key,
    channel_key,
    grants_key,
    held_key,
    job_key,
    lease_key,
    tenant_key,
)
from contracts.queues import ALL_QUEUES, RUN_JOB_TASK, Tier, queue_for
from contracts.registry import AdapterRecord, BaseModelRef
from contracts.tenants import ALL_ADAPTERS, ApiKeyRecord, TenantRecord

Command = tuple[str | bytes | int | float, ...]
CHANNELS = ("gateway", "gateway/kombu", "worker", "worker/kombu")
PARTS = {
    "all": CHANNELS,
    "data": ("gateway", "worker"),  # what the services send to LORAFLEET_REDIS_URL
    "broker": ("gateway/kombu", "worker/kombu"),  # kombu's transport: LORAFLEET_BROKER_URL
}
KOMBU_PRIORITIES = (0, 3, 6, 9)  # kombu's Redis transport: a list per queue and priority step
KOMBU_SEP = "\x06\x16"
TTL_S = 7 * 24 * 3600  # job records, as the services keep them
DEADLINE_S = 600.0
LEASE_TTL_S = 60.0
LIMITS = admission.Limits(tier_max=10**9, tenant_max=10**9, rate_per_s=1e9, burst=10**9)


def resp(command: Command) -> bytes:
    """One command in the Redis protocol."""
    parts = [f"*{len(command)}\r\n".encode()]
    for arg in command:
        data = arg if isinstance(arg, bytes) else str(arg).encode()
        parts += [f"${len(data)}\r\n".encode(), data, b"\r\n"]
    return b"".join(parts)


@dataclass(frozen=True)
class Trip:
    """One round trip: the commands a channel writes at once (a reply awaited for each)."""

    channel: int
    commands: tuple[Command, ...]
    payload: bytes

    @classmethod
    def of(cls, channel: str, *commands: Command) -> Trip:
        return cls(CHANNELS.index(channel), commands, b"".join(map(resp, commands)))

    def renamed(self, old: bytes, new: bytes) -> Trip:
        """The same trip for another job: ``old`` (an id's placeholder) becomes ``new``, of the
        same length, so every length in the protocol still holds."""
        return Trip(self.channel, (), self.payload.replace(old, new))


class Fixture:
    """One tenant, key and adapter in the server, and the records a job goes through."""

    TENANT = "bench"
    ALIAS = "invoices"
    WORKER = "gpu-7f9c:1:3a2b1c0d"

    def __init__(self, redis: Redis, broker_url: str) -> None:
        now = datetime.now(tz=UTC)
        self.key_hash = hashlib.sha256(b"lf_bench_secret").hexdigest()
        self.base = BaseModelRef(id="meta-llama/Llama-3.1-8B-Instruct", digest="b" * 64)
        self.record = AdapterRecord(
            alias=self.ALIAS,
            digest="a" * 64,
            base_model=self.base,
            rank=16,
            alpha=32,
            target_modules=("q_proj", "k_proj", "v_proj", "o_proj"),
            size_bytes=54_000_000,
            tier=Tier.HOT,
            created_at=now,
        )
        redis.set(
            api_key_key(self.key_hash),
            ApiKeyRecord(key_id="k1", tenant=self.TENANT, created_at=now).model_dump_json(),
        )
        redis.set(
            tenant_key(self.TENANT),
            TenantRecord(name=self.TENANT, created_at=now).model_dump_json(),
        )
        redis.sadd(grants_key(self.TENANT), ALL_ADAPTERS)
        redis.set(adapter_key(self.ALIAS), self.record.model_dump_json())
        self.envelope = self._celery_envelope(redis, broker_url)

    def _celery_envelope(self, redis: Redis, broker_url: str) -> bytes:
        """The message Celery publishes for a job (sent once to a scratch queue, read back)."""
        queue = f"capacity-{uuid.uuid4().hex}"
        producer = Celery("capacity", broker=broker_url)
        message = self.message("0" * 32)
        producer.send_task(RUN_JOB_TASK, args=[message.wire()], queue=queue, task_id="0" * 32)
        producer.close()
        raw = redis.rpop(queue)
        redis.delete(f"_kombu.binding.{queue}")
        assert isinstance(raw, bytes)
        return raw

    def message(self, job_id: str, at: float | None = None) -> JobMessage:
        accepted = at or time.time()
        return JobMessage(
            job_id=job_id,
            tenant=self.TENANT,
            adapter=self.ALIAS,
            revision=self.record.digest,
            base_model=self.base,
            tier=self.record.tier,
            prompt="Extract the total amount, the due date and the vendor name: " + "x" * 200,
            sampling=Sampling(max_tokens=8, temperature=0),
            accepted_at=accepted,
            deadline_at=accepted + DEADLINE_S,
        )

    def lifecycle(self, job_id: str, batch: str | None = None) -> tuple[JobPublic, ...]:
        """The job as admitted, as claimed, and as finished with a result."""
        now = datetime.now(tz=UTC)
        queued = JobPublic(
            id=job_id,
            status=JobStatus.QUEUED,
            tenant=self.TENANT,
            adapter=self.ALIAS,
            revision=self.record.digest,
            tier=self.record.tier,
            queue=queue_for(self.record.tier),
            created_at=now,
            deadline_at=now + timedelta(seconds=DEADLINE_S),
            batch=batch,
        )
        running = queued.model_copy(
            update={
                "status": JobStatus.RUNNING,
                "started_at": now,
                "attempts": 1,
                "worker": self.WORKER,
            }
        )
        result = JobResult(
            text=" The total is 1,240.00 EUR",
            token_ids=[415, 2564, 374, 220, 16, 11, 13461, 13],
            finish_reason="length",
            usage=Usage(prompt_tokens=61, completion_tokens=8, total_tokens=69),
        )
        metadata = ResultMetadata(
            adapter=self.ALIAS,
            revision=self.record.digest,
            loaded_digest=self.record.digest,
            identity_verified=True,
            base_model=self.base,
            residency_before="gpu",
            load_ms=LoadTimings(),
            queue_wait_ms=12.5,
            ttft_ms=18.25,
            e2e_ms=95.75,
            worker="gpu-7f9c",
            engine=EngineInfo(name="vllm", version="0.32.0"),
        )
        done = running.model_copy(
            update={
                "status": JobStatus.SUCCEEDED,
                "finished_at": now,
                "result": result,
                "metadata": metadata,
            }
        )
        return queued, running, done

    # -- what each side sends ---------------------------------------------------------------

    def authenticate(self) -> list[Trip]:
        """Every authenticated request: the key, then its tenant."""
        return [
            Trip.of("gateway", ("GET", api_key_key(self.key_hash))),
            Trip.of("gateway", ("GET", tenant_key(self.TENANT))),
        ]

    def resolve(self) -> list[Trip]:
        """The adapter named: channel and grant, then record and retirement."""
        return [
            Trip.of(
                "gateway",
                ("GET", channel_key(self.ALIAS)),
                ("SMISMEMBER", grants_key(self.TENANT), self.ALIAS, ALL_ADAPTERS),
            ),
            Trip.of(
                "gateway",
                ("GET", adapter_key(self.ALIAS)),
                ("SISMEMBER", RETIRED_INDEX, self.ALIAS),
            ),
        ]

    def publish(self, job_id: str) -> Trip:
        envelope = self.envelope.replace(b"0" * 32, job_id.encode())
        return Trip.of("gateway/kombu", ("LPUSH", queue_for(self.record.tier), envelope))

    def run(self, job_id: str, tag: str, batch: str | None = None) -> list[Trip]:
        """The worker: receive (kombu), record the delivery, claim, finish, ack."""
        _, running, done = self.lifecycle(job_id, batch)
        queues = [
            q if p == 0 else f"{q}{KOMBU_SEP}{p}" for p in KOMBU_PRIORITIES for q in ALL_QUEUES
        ]
        unacked = json.dumps([self.envelope.decode(), "", queue_for(self.record.tier)])
        lease = job_records.lease_value(self.WORKER, 1)
        claim = job_records.claim_call(running, 0, lease, LEASE_TTL_S, TTL_S)
        advance = job_records.advance_call(done, TTL_S, expect_attempts=1)
        return [
            Trip.of("worker/kombu", ("BRPOP", *queues, 1)),
            Trip.of(
                "worker/kombu",
                ("MULTI",),
                ("ZADD", "unacked_index", repr(time.time()), tag),
                ("HSET", "unacked", tag, unacked),
                ("EXEC",),
            ),
            Trip.of("worker", ("HSET", held_key(self.WORKER), tag, job_id)),
            Trip.of("worker", ("HGET", job_key(job_id), "record")),
            Trip.of("worker", ("EXISTS", lease_key(job_id))),
            Trip.of("worker", script(job_records.CLAIM, *claim)),
            Trip.of("worker", script(job_records.ADVANCE, *advance)),
            Trip.of(
                "worker/kombu",
                ("MULTI",),
                ("ZREM", "unacked_index", tag),
                ("HDEL", "unacked", tag),
                ("EXEC",),
            ),
            Trip.of("worker", ("HDEL", held_key(self.WORKER), tag)),
        ]

    def jobs_api(self, job_id: str, tag: str) -> list[Trip]:
        """``POST /v1/jobs``, the worker's run, one long-poll ``GET``."""
        queued, _, _ = self.lifecycle(job_id)
        expires_at = queued.deadline_at.timestamp() + admission.LEDGER_GRACE_S  # type: ignore[union-attr]
        admit = admission.admit_call(queued, expires_at, LIMITS, TTL_S)
        read = Trip.of("gateway", ("HGET", job_key(job_id), "record"))
        return [
            *self.authenticate(),
            *self.resolve(),
            Trip.of("gateway", script(admission.ADMIT, *admit)),
            self.publish(job_id),
            *self.authenticate(),
            read,  # the long-poll's first look: not finished
            *self.run(job_id, tag),
            read,  # woken by the job's event
        ]

    def batch(self, batch_id: str, job_ids: list[str], tags: list[str]) -> list[Trip]:
        """``POST /v1/batches``, every job's run, one status read, the results."""
        now = time.time()
        record = BatchRecord(
            id=batch_id,
            tenant=self.TENANT,
            endpoint="/v1/jobs",
            created_at=int(now),
            expires_at=int(now + DEADLINE_S),
        )
        jobs = [self.lifecycle(job_id, batch_id)[0] for job_id in job_ids]
        lines = [
            BatchLine(custom_id=f"r{n}", job_id=job_id, endpoint="/v1/jobs", model=self.ALIAS)
            for n, job_id in enumerate(job_ids)
        ]
        limits = admission.BatchLimits(
            tenant_max=LIMITS.tenant_max,
            rate_per_s=LIMITS.rate_per_s,
            burst=LIMITS.burst,
            tier_max=dict.fromkeys(Tier, LIMITS.tier_max),
        )
        admit = admission.admit_batch_call(
            record, jobs, lines, now + DEADLINE_S + 60, limits, TTL_S
        )
        read_batch = Trip.of("gateway", ("HGETALL", batch_key(batch_id)))
        return [
            *self.authenticate(),
            *self.resolve(),
            Trip.of("gateway", script(admission.ADMIT_BATCH, *admit)),
            *(self.publish(job_id) for job_id in job_ids),
            read_batch,
            *(
                trip
                for job_id, tag in zip(job_ids, tags, strict=True)
                for trip in self.run(job_id, tag, batch_id)
            ),
            *self.authenticate(),
            read_batch,  # a status poll
            *self.authenticate(),
            read_batch,
            Trip.of("gateway", ("LRANGE", batch_jobs_key(batch_id), 0, 499)),
            Trip.of("gateway", *(("HGET", job_key(job_id), "record") for job_id in job_ids)),
            Trip.of("gateway", ("LRANGE", batch_jobs_key(batch_id), 500, 999)),
        ]


def script(source: str, keys: list[str], args: list[Any]) -> Command:
    """``EVALSHA`` of a script the services have loaded (``load_scripts``)."""
    return ("EVALSHA", hashlib.sha1(source.encode()).hexdigest(), len(keys), *keys, *args)


def load_scripts(redis: Redis) -> None:
    """Load the scripts the mix calls by SHA-1 (the services' first calls do the same)."""
    for source in (admission.ADMIT, admission.ADMIT_BATCH, job_records.CLAIM, job_records.ADVANCE):
        redis.script_load(source)


class Mix:
    """The trips of one job (``jobs``) or one batch (``batch``), built once from a template
    and renamed for every replay: ids are ``<16 hex of the replay><16 hex of the slot>``."""

    def __init__(self, fixture: Fixture, kind: str, batch_size: int, part: str = "all") -> None:
        self.kind = kind
        self.part = part
        self.placeholder = uuid.uuid4().hex[:16]
        self.jobs = 1 if kind == "jobs" else batch_size
        job_ids = [f"{self.placeholder}{n:016x}" for n in range(self.jobs)]
        # kombu's delivery tags are uuid4 strings; these carry the placeholder too.
        p = self.placeholder
        tags = [f"{p[:8]}-{p[8:12]}-4{p[13:16]}-8000-{n:012x}" for n in range(self.jobs)]
        if kind == "jobs":
            self.template = fixture.jobs_api(job_ids[0], tags[0])
        else:
            self.template = fixture.batch(f"batch_{self.placeholder}{'0' * 16}", job_ids, tags)
        # Only the part one server would carry if the data and the broker were apart.
        self.trips = [trip for trip in self.template if CHANNELS[trip.channel] in PARTS[part]]

    @property
    def name(self) -> str:
        return self.kind if self.part == "all" else f"{self.kind}: {self.part} only"

    def fresh(self) -> list[Trip]:
        """The trips of a new job (or batch), under ids nobody used."""
        old, new = self.placeholder.encode(), uuid.uuid4().hex[:16].encode()
        return [trip.renamed(old, new) for trip in self.trips]

    def check(self, redis: Redis) -> None:
        """Run one instance through a plain client and make sure every script did its work
        (admitted, claimed, finished): a replay of refusals would measure nothing."""
        expected = {
            admission.ADMIT: [b"admitted", b"0"],
            admission.ADMIT_BATCH: [b"admitted", b"0"],
            job_records.CLAIM: job_records.Advance.WRITTEN,
            job_records.ADVANCE: job_records.Advance.WRITTEN,
        }
        by_sha = {hashlib.sha1(lua.encode()).hexdigest(): want for lua, want in expected.items()}
        for trip in self.template:
            for command in trip.commands:
                reply = redis.execute_command(*command)
                if command[0] == "EVALSHA":
                    want = by_sha[str(command[1])]
                    if reply != want:
                        raise RuntimeError(f"replayed script returned {reply!r}, not {want!r}")
