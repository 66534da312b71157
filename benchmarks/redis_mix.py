"""The Redis traffic of one job, as each side sends it: what ``redis_capacity.py`` replays.

Written from the code as of ``59e450c`` (``benchmarks/REDIS_CLUSTER.md``, "What one job
costs now"), round trip by round trip: the gateway's access script (``gateway.access.ACCESS``;
since ``a0fc676`` not before a ``POST /v1/jobs``, whose access is recalled and checked inside
``ADMIT``), ``ADMIT`` (or ``ADMIT_BATCH``) with the jobs' task messages, the long-poll's and
the results' reads; the worker's kombu receipt, claim, terminal write, ack and held-delivery
writes. The scripts, their argument builders and the task message are the project's own
(``gateway.access``, ``contracts.admission``, ``contracts.job_records``,
``gateway.queue.job_message``), so a change inside a script is replayed as it is; a change in
what the services send (fewer round trips, merged scripts) is made here.
``redis_capacity.py --cost-json`` lists, command by command, where this mix and the one
``redis_cost.py`` measured differ. The mix of ``fcd311d`` and before is not kept: its figures
are in ``benchmarks/results/*before-fcd311d*``.
"""

from __future__ import annotations

import hashlib
import json
import time
import uuid
from dataclasses import dataclass
from datetime import UTC, datetime, timedelta
from typing import Any

from redis import Redis

from contracts import admission, job_records
from contracts.admission import ACCESS_PREFIXES
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
    adapter_key,
    api_key_key,
    batch_jobs_key,
    batch_key,
    grants_key,
    held_key,
    job_key,
    tenant_key,
)
from contracts.queues import Tier, pool_queues, queue_for
from contracts.registry import AdapterRecord, BaseModelRef
from contracts.tenants import ALL_ADAPTERS, ApiKeyRecord, TenantRecord
from gateway.access import ACCESS
from gateway.batches import READ_CHUNK
from gateway.queue import job_message

Command = tuple[str | bytes | int | float, ...]
CHANNELS = ("gateway", "gateway/broker", "worker", "worker/kombu")
PARTS = {
    # One Redis for records and queues (LORAFLEET_BROKER_URL unset): ADMIT pushes the message.
    "all": CHANNELS,
    # A broker of its own: what each server carries. ADMIT pushes nothing; the gateway sends
    # the messages to the broker in one pipeline after it (gateway.queue.JobQueues.push).
    "data": ("gateway", "worker"),
    "broker": ("gateway/broker", "worker/kombu"),
}
KOMBU_PRIORITIES = (0, 3, 6, 9)  # kombu's Redis transport: a list per queue and priority step
KOMBU_SEP = "\x06\x16"
BASE_DIGEST = "sha256:" + "b" * 64
KOMBU_QUEUES = [
    q if p == 0 else f"{q}{KOMBU_SEP}{p}"
    for p in KOMBU_PRIORITIES
    for q in pool_queues(BASE_DIGEST)
]
TTL_S = 7 * 24 * 3600  # job records, as the services keep them
DEADLINE_S = 600.0
LEASE_TTL_S = 60.0
MAX_ATTEMPTS = 3
LIMITS = admission.Limits(tier_max=10**9, tenant_max=10**9, rate_per_s=1e9, burst=10**9)
SCRIPTS = {
    "ACCESS": ACCESS,
    "ADMIT": admission.ADMIT,
    "ADMIT_BATCH": admission.ADMIT_BATCH,
    "CLAIM": job_records.CLAIM,
    "ADVANCE": job_records.ADVANCE,
}
SCRIPT_NAMES = {hashlib.sha1(lua.encode()).hexdigest(): name for name, lua in SCRIPTS.items()}


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


def script(source: str, keys: list[str], args: list[Any]) -> Command:
    """``EVALSHA`` of a script the services have loaded (``load_scripts``)."""
    return ("EVALSHA", hashlib.sha1(source.encode()).hexdigest(), len(keys), *keys, *args)


def load_scripts(redis: Redis) -> None:
    """Load the scripts the mix calls by SHA-1 (the services' first calls do the same)."""
    for source in SCRIPTS.values():
        redis.script_load(source)


class Fixture:
    """One tenant, key and adapter in the server, and the records a job goes through."""

    TENANT = "bench"
    ALIAS = "invoices"
    WORKER = "gpu-7f9c:1:3a2b1c0d"

    def __init__(self, redis: Redis) -> None:
        now = datetime.now(tz=UTC)
        self.key_hash = hashlib.sha256(b"lf_bench_secret").hexdigest()
        self.base = BaseModelRef(id="meta-llama/Llama-3.1-8B-Instruct", digest=BASE_DIGEST)
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
        self.queue = queue_for(self.record.tier, self.base.digest)
        key = ApiKeyRecord(key_id="k1", tenant=self.TENANT, created_at=now).model_dump_json()
        tenant = TenantRecord(name=self.TENANT, created_at=now).model_dump_json()
        adapter = self.record.model_dump_json()
        redis.set(api_key_key(self.key_hash), key)
        redis.set(tenant_key(self.TENANT), tenant)
        redis.sadd(grants_key(self.TENANT), ALL_ADAPTERS)
        redis.set(adapter_key(self.ALIAS), adapter)
        # What ``ACCESS`` reads of them (no channel, granted by ``*``, not retired): the
        # witness of the access a gateway recalls (``gateway.access.recall``).
        self.recalled = admission.Recalled(
            api_key_key(self.key_hash),
            self.ALIAS,
            admission.witness([key, tenant, None, 1, adapter, 0]),
        )

    def message(self, job_id: str, tag: str, at: float) -> str:
        """The task message the gateway writes for the job (``gateway.queue.job_message``),
        its broker delivery tag made ``tag`` so that it is renamed with the job. Its body is
        base64: the job id inside stays the template's (same length; nothing here decodes it)."""
        job = JobMessage(
            job_id=job_id,
            tenant=self.TENANT,
            adapter=self.ALIAS,
            revision=self.record.digest,
            base_model=self.base,
            tier=self.record.tier,
            prompt="Extract the total amount, the due date and the vendor name: " + "x" * 200,
            sampling=Sampling(max_tokens=8, temperature=0),
            accepted_at=at,
            deadline_at=at + DEADLINE_S,
        )
        envelope = json.loads(job_message(job))
        envelope["properties"]["delivery_tag"] = tag
        return json.dumps(envelope, separators=(",", ":"))

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
            queue=self.queue,
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

    def access(self, name: str = "") -> Trip:
        """``gateway.access.check``: the key and its tenant; with ``name``, also its grant,
        channel, record and retirement (the admission routes' dependency)."""
        command = script(ACCESS, [api_key_key(self.key_hash)], [*ACCESS_PREFIXES, name])
        return Trip.of("gateway", command)

    def read(self, job_id: str) -> Trip:
        """``gateway.job_store.get_job``: the long-poll's read of the record."""
        return Trip.of("gateway", ("HMGET", job_key(job_id), *job_records.RECORD_FIELDS))

    def publish(self, messages: list[str]) -> list[Trip]:
        """A broker of its own: ``JobQueues.push``, one pipeline after the admission."""
        if not messages:
            return []
        return [Trip.of("gateway/broker", *(("LPUSH", self.queue, m) for m in messages))]

    def run(self, jobs: list[tuple[str, str, str]], batch: str | None = None) -> list[Trip]:
        """The worker, for ``(job id, delivery tag, message)`` received together: each is
        received by kombu (``BRPOP``, then its unacked bookkeeping); their claims go in one
        pipeline (``worker.script_batch``), as do their outcomes; the held-delivery writer
        records them in one write and clears them in another (``worker.held``); kombu acks
        each."""
        trips = []
        claims, advances = [], []
        for job_id, tag, message in jobs:
            unacked = json.dumps([json.loads(message), "", self.queue])  # kombu's QoS.append
            trips += [
                Trip.of("worker/kombu", ("BRPOP", *KOMBU_QUEUES, 1)),
                Trip.of(
                    "worker/kombu",
                    ("MULTI",),
                    ("ZADD", "unacked_index", repr(time.time()), tag),
                    ("HSET", "unacked", tag, unacked),
                    ("EXEC",),
                ),
            ]
            _, running, done = self.lifecycle(job_id, batch)
            claim = job_records.claim_call(
                job_id,
                self.WORKER,
                running.started_at,  # type: ignore[arg-type]
                MAX_ATTEMPTS,
                False,
                LEASE_TTL_S,
                TTL_S,
                tag,
            )
            claims.append(script(job_records.CLAIM, *claim))
            advances.append(script(job_records.ADVANCE, *job_records.advance_call(done, TTL_S, 1)))
        held = held_key(self.WORKER)
        trips += [
            Trip.of("worker", *claims),
            # Gathered for 5 ms, the receipt's write lands after the claims (which hold too).
            Trip.of("worker", *(("HSET", held, tag, job_id) for job_id, tag, _ in jobs)),
            Trip.of("worker", *advances),
            *(
                Trip.of(
                    "worker/kombu",
                    ("MULTI",),
                    ("ZREM", "unacked_index", tag),
                    ("HDEL", "unacked", tag),
                    ("EXEC",),
                )
                for _, tag, _ in jobs
            ),
            Trip.of("worker", *(("HDEL", held, tag) for _, tag, _ in jobs)),
        ]
        return trips

    def jobs_api(self, job_ids: list[str], tags: list[str], inline: bool) -> list[Trip]:
        """For each job, ``POST /v1/jobs`` and the long-poll ``GET``'s first read; the
        worker's run of them all; then each long-poll's read when the job's event wakes it.
        The ``POST``'s access is recalled (its gateway read it before: no ``ACCESS``, the
        admission checks it), as for every request of a key after its process's first."""
        trips, received = [], []
        for job_id, tag in zip(job_ids, tags, strict=True):
            queued, _, _ = self.lifecycle(job_id)
            message = self.message(job_id, tag, queued.created_at.timestamp())
            expires_at = queued.created_at.timestamp() + DEADLINE_S + admission.LEDGER_GRACE_S
            admit = admission.admit_call(
                queued,
                expires_at,
                LIMITS,
                TTL_S,
                message=message if inline else None,
                recalled=self.recalled,
            )
            trips += [
                Trip.of("gateway", script(admission.ADMIT, *admit)),
                *self.publish([] if inline else [message]),
                self.access(),
                self.read(job_id),  # not finished yet
            ]
            received.append((job_id, tag, message))
        return [*trips, *self.run(received), *(self.read(job_id) for job_id in job_ids)]

    def batch(
        self, batch_id: str, job_ids: list[str], tags: list[str], inline: bool, wave: int
    ) -> list[Trip]:
        """``POST /v1/batches``, the worker's runs (``wave`` jobs received together), one
        status poll, then the results."""
        now = time.time()
        record = BatchRecord(
            id=batch_id,
            tenant=self.TENANT,
            endpoint="/v1/jobs",
            created_at=int(now),
            expires_at=int(now + DEADLINE_S),
        )
        jobs = [self.lifecycle(job_id, batch_id)[0] for job_id in job_ids]
        messages = [self.message(j, t, now) for j, t in zip(job_ids, tags, strict=True)]
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
            record,
            jobs,
            lines,
            now + DEADLINE_S + admission.LEDGER_GRACE_S,
            limits,
            TTL_S,
            messages=messages if inline else None,
        )
        read_batch = Trip.of("gateway", ("HGETALL", batch_key(batch_id)))
        received = list(zip(job_ids, tags, messages, strict=True))
        results = []  # gateway.batches.Batches.lines: a chunk of lines, their records, ...
        key = batch_jobs_key(batch_id)
        for start in range(0, len(job_ids) + READ_CHUNK, READ_CHUNK):
            chunk = job_ids[start : start + READ_CHUNK]
            results.append(Trip.of("gateway", ("LRANGE", key, start, start + READ_CHUNK - 1)))
            if chunk:  # else the empty answer that ends the reading
                fields = job_records.RECORD_FIELDS
                results.append(Trip.of("gateway", *(("HMGET", job_key(j), *fields) for j in chunk)))
        return [
            self.access(),  # the route's tenant
            self.access(self.ALIAS),  # Batches.create resolves each name the lines use
            Trip.of("gateway", script(admission.ADMIT_BATCH, *admit)),
            *self.publish([] if inline else messages),
            read_batch,  # the answer: Batches.get
            *(
                trip
                for start in range(0, len(received), wave)
                for trip in self.run(received[start : start + wave], batch_id)
            ),
            self.access(),
            read_batch,  # a status poll
            self.access(),
            read_batch,  # the results: the batch, then its lines and records
            *results,
        ]


class Mix:
    """The trips of ``wave`` jobs of the jobs API (``jobs``) or of one batch (``batch``), built
    once from a template and renamed for every replay: ids are ``<16 hex of the replay><16
    hex of the slot>``. ``wave``: jobs a worker receives together, whose claims, outcomes and
    held-delivery writes share round trips (1: none shared, a lightly loaded worker)."""

    def __init__(
        self, fixture: Fixture, kind: str, batch_size: int, part: str = "all", wave: int = 1
    ) -> None:
        self.kind = kind
        self.part = part
        self.wave = wave
        self.placeholder = uuid.uuid4().hex[:16]
        self.jobs = wave if kind == "jobs" else batch_size
        self.job_ids = [f"{self.placeholder}{n:016x}" for n in range(self.jobs)]
        # Delivery tags are uuid4 strings; these carry the placeholder too.
        p = self.placeholder
        tags = [f"{p[:8]}-{p[8:12]}-4{p[13:16]}-8000-{n:012x}" for n in range(self.jobs)]
        inline = part == "all"
        if kind == "jobs":
            self.template = fixture.jobs_api(self.job_ids, tags, inline)
        else:
            batch_id = f"batch_{self.placeholder}{'0' * 16}"
            self.template = fixture.batch(batch_id, self.job_ids, tags, inline, wave)
        # Only the part one server would carry if the data and the broker were apart.
        self.trips = [trip for trip in self.template if CHANNELS[trip.channel] in PARTS[part]]

    @property
    def name(self) -> str:
        name = self.kind if self.part == "all" else f"{self.kind}: {self.part} only"
        return name if self.wave == 1 else f"{name}, waves of {self.wave}"

    def fresh(self) -> list[Trip]:
        """The trips of new jobs (or a new batch), under ids nobody used."""
        old, new = self.placeholder.encode(), uuid.uuid4().hex[:16].encode()
        return [trip.renamed(old, new) for trip in self.trips]

    def check(self, redis: Redis) -> None:
        """Run one instance through a plain client and make sure every script did its work
        (resolved, admitted and pushed, claimed, finished): a replay of refusals, or of an
        admission that only found its own earlier run, would measure nothing."""
        redis.delete(*KOMBU_QUEUES)  # so every message received is one this instance pushed
        for trip in self.template:
            for command in trip.commands:
                name = SCRIPT_NAMES.get(str(command[1])) if command[0] == "EVALSHA" else None
                # What ADMIT (KEYS[4], the record) or ADMIT_BATCH (KEYS[3], the batch) creates.
                created = {"ADMIT": 6, "ADMIT_BATCH": 5}.get(name or "")
                if created is not None and redis.exists(str(command[created])):
                    raise RuntimeError(f"{name} would find {command[created]!r}: a no-op")
                name = name or str(command[0])
                reply = redis.execute_command(*command)
                if not _did_its_work(name, command, reply, self.job_ids):
                    raise RuntimeError(f"replayed {name} answered {reply!r}")


def _did_its_work(name: str, command: Command, reply: Any, job_ids: list[str]) -> bool:
    """Whether ``reply`` to ``command`` shows it did what the services' call does."""
    if name == "ACCESS":
        if command[-1] == "":  # authentication only: the key and its tenant
            return len(reply) == 2 and reply[1] is not None
        return len(reply) == 6 and reply[3] == 1 and reply[4] is not None and reply[5] == 0
    if name in ("ADMIT", "ADMIT_BATCH"):
        return bool(reply == [b"admitted", b"0"])
    if name == "CLAIM":
        return bool(reply[0] == b"run")
    if name == "ADVANCE":
        return bool(reply == job_records.Advance.WRITTEN)
    if name == "BRPOP":
        return reply is not None and json.loads(reply[1])["headers"]["id"] in job_ids
    if name == "HMGET":
        return reply[0] is not None
    return True
