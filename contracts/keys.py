"""Redis key layout shared by every process (one place, so a rename breaks loudly)."""

from __future__ import annotations

import hashlib

PREFIX = "lorafleet"

NO_KEY = f"{PREFIX}:none"
"""Placeholder for a key a script call does not touch (no webhook, no batch, no queue)."""


def adapter_key(alias: str) -> str:
    """JSON ``AdapterRecord`` of one alias."""
    return f"{PREFIX}:adapter:{alias}"


ADAPTERS_INDEX = f"{PREFIX}:adapters"
"""Set of every registered alias."""

RETIRED_INDEX = f"{PREFIX}:adapters:retired"
"""Set of retired aliases: still resolvable for queued jobs, refused for new ones."""


def channel_key(name: str) -> str:
    """String: the alias a channel points to now."""
    return f"{PREFIX}:channel:{name}"


CHANNELS_INDEX = f"{PREFIX}:channels"
"""Set of every channel name."""


def job_key(job_id: str) -> str:
    """Hash: one job's public record (``record``, JSON), ``status`` and ``attempts``, and
    the fields ``contracts.job_records`` lists beside them."""
    return f"{PREFIX}:job:{job_id}"


JOB_EVENTS = f"{PREFIX}:job-events"
"""Pub/sub channel: a job id is published each time a job reaches a terminal state."""


def reply_channel(gateway_id: str) -> str:
    """Pub/sub channel of one gateway process: the final record of each job it admitted for a
    caller who waits for it there (``contracts.job_records.ADVANCE``), so that it need not
    read the record back."""
    return f"{PREFIX}:job-replies:{gateway_id}"


JOB_CANCELS = f"{PREFIX}:job-cancels"
"""Pub/sub channel: a job id is published when a caller cancels it (workers abort it)."""


def worker_key(worker_id: str) -> str:
    """JSON heartbeat a worker writes once its engine is ready, refreshed while it lives."""
    return f"{PREFIX}:worker:{worker_id}"


def lease_key(job_id: str) -> str:
    """String ``<worker id>|<attempt>``: the attempt that runs a job right now. Set by the
    claim, refreshed by its worker while the attempt lives, gone once the job is queued again
    or finished; a delivery of a job whose lease is held elsewhere waits instead of running it
    a second time (``contracts.job_records.CLAIM``)."""
    return f"{PREFIX}:lease:{job_id}"


DEADLINES = f"{PREFIX}:deadlines"
"""Sorted set ``job id -> deadline`` (unix seconds) of every admitted, unfinished job: the
deadline sweeper's index (``worker.sweeper``)."""

SWEEPER = f"{PREFIX}:sweeper"
"""String: id of the process elected to sweep deadlines (expires unless its holder renews it)."""


def held_key(worker_id: str) -> str:
    """Hash ``broker delivery tag -> task id`` of the deliveries a worker has received and not
    yet finished; a dead worker's entries are handed back to their queues (``worker.reaper``).
    Keyed by delivery, not by job: two deliveries of one job are two entries."""
    return f"{PREFIX}:held:{worker_id}"


def routed_key(worker_id: str) -> str:
    """Sorted set ``job id -> deadline`` of the jobs routed to a worker's own queue that no
    worker has received yet; their messages are kept in their job hashes (``message``) until
    then. A worker that dies while blocked on its queue can take one message with it (the
    reply to its pending ``BRPOP`` lands in a dead socket): when it is gone, the queue
    keepers push the message of each such job still ``queued`` again (``worker.reaper``)."""
    return f"{PREFIX}:routed:{worker_id}"


REGISTRY_VERSION = f"{PREFIX}:registry-version"
"""Counter bumped by every registry change that can change which adapters are hot (a
publish, a retirement): workers read it every ``LORAFLEET_PIN_CHECK_S`` to pin or unpin live.
Permanent, like the registry."""

POOLS = f"{PREFIX}:pools"
"""Hash ``pool id -> BaseModelRef JSON`` of every base model an adapter was published for or
a worker served (``contracts.queues.pool_id``): the pools whose queues the gateways report
(``GET /metrics``, ``GET /v1/fleet``), even before a worker of the pool has started.
Permanent, like the registry."""


def engine_proven_key(engine_version: str) -> str:
    """Set of adapter revisions an engine of ``engine_version`` loaded and survived: only
    those are registered in an engine ahead of their jobs (a prefetch must never be the
    first to hand an engine an adapter that could kill it)."""
    return f"{PREFIX}:engine-proven:{engine_version}"


ENGINE_PROVEN_TTL_S = 30 * 24 * 3600
"""Refreshed at every addition."""

WORKERS_INDEX = f"{PREFIX}:workers"
"""Set of the ids (``host:pid:boot``) of workers that have announced themselves."""

WORKER_QUEUES = f"{PREFIX}:worker-queues"
"""Sorted set ``worker id -> unix time it last announced itself serving``: whose own queue
(``contracts.routing.worker_queue``) the reapers watch, so that no routed job is stranded in
the queue of a worker that stopped, drains or died (``worker.reaper``)."""


def tenant_key(name: str) -> str:
    """JSON ``TenantRecord``."""
    return f"{PREFIX}:tenant:{name}"


TENANTS_INDEX = f"{PREFIX}:tenants"
"""Set of every tenant name."""


def api_key_key(hashed: str) -> str:
    """JSON ``ApiKeyRecord`` stored under the SHA-256 of the key."""
    return f"{PREFIX}:apikey:{hashed}"


def tenant_keys_key(tenant: str) -> str:
    """Hash ``key id -> key hash`` of a tenant's live keys (for listing and revocation)."""
    return f"{PREFIX}:tenant-keys:{tenant}"


def grants_key(tenant: str) -> str:
    """Set of the aliases and channels a tenant may use (``*``: all of them)."""
    return f"{PREFIX}:grants:{tenant}"


def queue_ledger_key(queue: str) -> str:
    """Sorted set ``job id -> expiry`` of the jobs admitted to a pool queue (one tier of one
    base model's pool, ``contracts.queues.queue_for``) and not finished."""
    return f"{PREFIX}:ledger:queue:{queue}"


def tenant_ledger_key(tenant: str) -> str:
    """Sorted set ``job id -> expiry`` of a tenant's admitted, unfinished jobs."""
    return f"{PREFIX}:ledger:tenant:{tenant}"


def rate_key(tenant: str) -> str:
    """Hash ``{tokens, at}``: the tenant's admission token bucket."""
    return f"{PREFIX}:rate:{tenant}"


def idempotency_key(tenant: str, key: str) -> str:
    """JSON ``{body, job}`` of one ``Idempotency-Key`` (the caller's key is hashed)."""
    return f"{PREFIX}:idem:{tenant}:{hashlib.sha256(key.encode()).hexdigest()}"


def base_card_key(digest: str) -> str:
    """JSON ``BaseModelCard`` a worker writes for the base model it serves."""
    return f"{PREFIX}:base:{digest}"


def tokenizer_key(sha256: str) -> str:
    """A ``tokenizer.json``, stored once by content hash."""
    return f"{PREFIX}:tokenizer:{sha256}"


def stream_key(job_id: str) -> str:
    """Redis stream of a streaming job: opened at admission (``STREAM_OPENED``), then its text
    deltas, in order, per attempt; its last entry, once the job is terminal, is the end
    marker (``STREAM_END``)."""
    return f"{PREFIX}:stream:{job_id}"


STREAM_OPENED = "opened"
"""Field of the first entry of a job's stream, written by the script that admits a job whose
caller streams (``contracts.admission.ADMIT``): the stream exists from the job's first
moment, so the script that makes the job terminal always finds it and appends the end
marker, even to a job that failed before it streamed a word."""

STREAM_TTL_S = 3600
"""How long a job's stream is kept after its last entry (its job's record, if kept for less,
bounds it too)."""

STREAM_OPENED_ID = "0-1"
"""The id of that first entry (the least a stream entry can have; every later entry's is
time-based): a reader that knows the stream was opened reads from past it."""

STREAM_END = "end"
"""Field of the entry ``ADVANCE`` appends to a job's stream (if it has one) in the script
that makes the job terminal, its value the status; beside it the record as written
(``record``) and the attempts counter (``attempts``): a reader waiting on the stream learns
the end, and the outcome, at once instead of at its next look at the record."""


def webhook_event_key(event_id: str) -> str:
    """Hash: one callback event's target and delivery state (``contracts.webhooks``)."""
    return f"{PREFIX}:webhook:{event_id}"


WEBHOOKS_DUE = f"{PREFIX}:webhooks-due"
"""Sorted set ``event id -> unix time of its next attempt`` (a lease while one runs)."""


def webhook_secrets_key(tenant: str) -> str:
    """JSON list of a tenant's live signing secrets, newest first."""
    return f"{PREFIX}:webhook-secrets:{tenant}"


def batch_key(batch_id: str) -> str:
    """Hash: a batch's record and its counts by terminal status."""
    return f"{PREFIX}:batch:{batch_id}"


def batch_jobs_key(batch_id: str) -> str:
    """List of a batch's job ids, in submission order."""
    return f"{PREFIX}:batch:{batch_id}:jobs"


def file_key(file_id: str) -> str:
    """Hash ``{meta, content}`` of an uploaded file (OpenAI's Files API, purpose ``batch``)."""
    return f"{PREFIX}:file:{file_id}"


def tenant_files_key(tenant: str) -> str:
    """Sorted set: the tenant's uploaded file ids by expiry (unix seconds), for its quota."""
    return f"{PREFIX}:files:{tenant}"


def tenant_file_bytes_key(tenant: str) -> str:
    """Hash: file id -> size in bytes of each of the tenant's uploaded files."""
    return f"{PREFIX}:files-bytes:{tenant}"
