"""Prometheus metric names: one place, shared by the gateway, the worker and the shipped
alert rules (``infra/``), so a rename breaks the manifest test rather than an alert."""

from __future__ import annotations

# Gateway
QUEUE_DEPTH = "lorafleet_queue_depth"
ADMITTED_UNFINISHED = "lorafleet_admitted_unfinished"
QUEUE_OLDEST_AGE = "lorafleet_queue_oldest_age_seconds"
JOBS_ADMITTED = "lorafleet_jobs_admitted_total"
ADMISSIONS_REFUSED = "lorafleet_admissions_refused_total"
ADAPTER_REQUESTS = "lorafleet_adapter_requests_total"
ROUTING_DECISIONS = "lorafleet_routing_decisions_total"
ADAPTER_COPIES = "lorafleet_adapters_by_copies"
ACCESS_RECALLS = "lorafleet_access_recalls_total"
# Gateway (cancellations) and worker (everything else)
JOBS_FINISHED = "lorafleet_jobs_finished_total"
# Gateway and worker: registry records a reader skipped because they do not parse
REGISTRY_RECORDS_INVALID = "lorafleet_registry_records_invalid_total"
# Gateway and worker: the start-up heap set aside from garbage collection
HEAP_FROZEN = "lorafleet_heap_frozen_objects"
# Worker
JOB_E2E = "lorafleet_job_e2e_seconds"
JOB_QUEUE_WAIT = "lorafleet_job_queue_wait_seconds"
JOB_TTFT = "lorafleet_job_ttft_seconds"
JOB_SLOT_WAIT = "lorafleet_job_slot_wait_seconds"
ADAPTER_LOOKUPS = "lorafleet_adapter_lookups_total"
ADAPTER_LOAD = "lorafleet_adapter_load_seconds"
ADAPTER_EVICTIONS = "lorafleet_adapter_evictions_total"
ADAPTERS_RESIDENT = "lorafleet_adapters_resident"
IDENTITY_CHECKS = "lorafleet_identity_checks_total"
JOB_DELIVERIES = "lorafleet_job_deliveries_total"
ENGINE_FAILURES = "lorafleet_engine_failures_total"
DEADLINE_BEYOND_VISIBILITY = "lorafleet_deadline_beyond_visibility_total"
JOB_CPU = "lorafleet_job_cpu_seconds_total"
ADAPTER_PREFETCHES = "lorafleet_adapter_prefetches_total"
PREFETCH_OUTCOMES = ("started", "disk", "cpu", "used", "wasted", "failed")
"""The ``outcome`` label values of ``ADAPTER_PREFETCHES``."""

OTHER = "other"
"""The ``adapter`` label of requests for aliases beyond the top K."""

ALL = frozenset(
    {
        QUEUE_DEPTH,
        ADMITTED_UNFINISHED,
        QUEUE_OLDEST_AGE,
        JOBS_ADMITTED,
        ADMISSIONS_REFUSED,
        ADAPTER_REQUESTS,
        ROUTING_DECISIONS,
        ADAPTER_COPIES,
        ACCESS_RECALLS,
        JOBS_FINISHED,
        REGISTRY_RECORDS_INVALID,
        HEAP_FROZEN,
        JOB_E2E,
        JOB_QUEUE_WAIT,
        JOB_TTFT,
        JOB_SLOT_WAIT,
        ADAPTER_LOOKUPS,
        ADAPTER_LOAD,
        ADAPTER_EVICTIONS,
        ADAPTERS_RESIDENT,
        IDENTITY_CHECKS,
        JOB_DELIVERIES,
        ENGINE_FAILURES,
        DEADLINE_BEYOND_VISIBILITY,
        JOB_CPU,
        ADAPTER_PREFETCHES,
    }
)
