"""The worker's Prometheus metrics, served on ``LORAFLEET_METRICS_PORT`` with vLLM's own
(``vllm:num_requests_running``, ``vllm:num_requests_waiting``, ``vllm:kv_cache_usage_perc``:
the engine registers them in the same default registry), and its probes on the same port:
``/readyz`` (200 while it takes jobs) and ``/livez`` (200 until its engine failed).

Several worker processes on one host: each binds the first free port from the configured
one (``0``: any free port) and announces the port it got in its heartbeat.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

from prometheus_client import CONTENT_TYPE_LATEST, REGISTRY, Counter, Gauge, Histogram
from prometheus_client.exposition import generate_latest

from contracts import metrics as names
from contracts.errors import ErrorCode
from contracts.jobs import JobMessage, ResultMetadata

log = logging.getLogger(__name__)

PORT_ATTEMPTS = 32
_LATENCY_BUCKETS = (0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 120, 300, 600)

JOBS_FINISHED = Counter(
    names.JOBS_FINISHED, "Jobs that reached a terminal state.", ["tier", "status", "code"]
)
E2E = Histogram(names.JOB_E2E, "Admission to outcome, seconds.", ["tier"], buckets=_LATENCY_BUCKETS)
QUEUE_WAIT = Histogram(
    names.JOB_QUEUE_WAIT,
    "Admission to start on a worker, seconds.",
    ["tier"],
    buckets=_LATENCY_BUCKETS,
)
TTFT = Histogram(
    names.JOB_TTFT, "Engine arrival to first token, seconds.", ["tier"], buckets=_LATENCY_BUCKETS
)
SLOT_WAIT = Histogram(
    names.JOB_SLOT_WAIT,
    "Wait for a GPU adapter slot on the worker, seconds (LORAFLEET_SLOT_DRAIN_AFTER_S bounds "
    "how long before the oldest adapter drains for it).",
    ["tier"],
    buckets=_LATENCY_BUCKETS,
)
LOOKUPS = Counter(
    names.ADAPTER_LOOKUPS,
    "Jobs by where their adapter was before them (gpu/cpu: hit; disk, remote: miss).",
    ["level"],
)
LOAD = Histogram(
    names.ADAPTER_LOAD,
    "Adapter loading phases, seconds, by where the adapter came from.",
    ["phase", "source"],
    buckets=_LATENCY_BUCKETS,
)
EVICTIONS = Counter(names.ADAPTER_EVICTIONS, "Adapters evicted, by level.", ["level"])
PREFETCHES = Counter(
    names.ADAPTER_PREFETCHES,
    "Adapter prefetches by trigger (lookahead, popularity, warmup) and outcome: started (a "
    "download); made resident on disk or in the engine (disk, cpu); used (a job found it "
    "there); wasted (evicted unused); failed (the download, verification or engine failed).",
    ["trigger", "outcome"],
)
RESIDENT = Gauge(names.ADAPTERS_RESIDENT, "Adapters resident on this worker.", ["level"])
IDENTITY = Counter(
    names.IDENTITY_CHECKS,
    "Adapter identity checks before generation (mismatched must stay 0).",
    ["result"],
)
DELIVERIES = Counter(
    names.JOB_DELIVERIES,
    "Job deliveries by what the claim decided (run, finished, missing, exhausted, "
    "elsewhere: another attempt held the job to its deadline, abandoned: handed back).",
    ["outcome"],
)
REGISTRY_RECORDS_INVALID = Counter(
    names.REGISTRY_RECORDS_INVALID,
    "Registry records skipped while preloading because they do not parse.",
)
ENGINE_FAILURES = Counter(
    names.ENGINE_FAILURES, "Times this worker's engine failed (the worker then exits)."
)
JOB_CPU = Counter(
    names.JOB_CPU,
    "CPU seconds of the worker's own handling of the jobs it ran, by phase: start (task "
    "body to engine submission: message, claim, residency) and finish (engine result to "
    "stored outcome). Celery's receipt and ack and the engine's frontend are not in it.",
    ["phase"],
)
HEAP_FROZEN = Gauge(
    names.HEAP_FROZEN,
    "Objects of this process's start-up heap frozen out of garbage collection "
    "(contracts.warm_process); 0 until the worker is ready.",
)
DEADLINE_BEYOND_VISIBILITY = Counter(
    names.DEADLINE_BEYOND_VISIBILITY,
    "Jobs whose deadline outlasts this worker's visibility timeout (raise the timeout).",
)

Probe = Callable[[], bool]
READY_PATH = "/readyz"
LIVE_PATH = "/livez"


def serve(port: int, ready: Probe, live: Probe) -> int:
    """Serve the metrics and the probes on ``port`` or the next free one; the port in use."""
    candidates = [0] if port == 0 else list(range(port, port + PORT_ATTEMPTS))
    for candidate in candidates:
        try:
            server = ThreadingHTTPServer(("", candidate), _handler(ready, live))
        except OSError:
            continue
        server.daemon_threads = True
        threading.Thread(target=server.serve_forever, name="metrics", daemon=True).start()
        return int(server.server_port)
    raise OSError(f"no free metrics port in {port}..{port + PORT_ATTEMPTS - 1}")


def _handler(ready: Probe, live: Probe) -> type[BaseHTTPRequestHandler]:
    class Handler(BaseHTTPRequestHandler):
        def do_GET(self) -> None:
            path = self.path.split("?", 1)[0]
            if path in (READY_PATH, LIVE_PATH):
                ok = (ready if path == READY_PATH else live)()
                self._answer(200 if ok else 503, b"ok\n" if ok else b"no\n", "text/plain")
            else:
                self._answer(200, generate_latest(REGISTRY), CONTENT_TYPE_LATEST)

        def _answer(self, status: int, body: bytes, content_type: str) -> None:
            self.send_response(status)
            self.send_header("Content-Type", content_type)
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)

        def log_message(self, *_: object) -> None:  # scrapes and probes are not news
            return

    return Handler


def job_finished(
    message: JobMessage, status: str, code: ErrorCode | None, metadata: ResultMetadata | None
) -> None:
    """Count one stored outcome (call only when this delivery wrote it)."""
    tier = message.tier.value
    JOBS_FINISHED.labels(tier, status, code.value if code else "").inc()
    if code == ErrorCode.ADAPTER_INTEGRITY:
        IDENTITY.labels("mismatched").inc()
    if metadata is None:
        return
    E2E.labels(tier).observe(metadata.e2e_ms / 1000)
    QUEUE_WAIT.labels(tier).observe(metadata.queue_wait_ms / 1000)
    if metadata.ttft_ms is not None:
        TTFT.labels(tier).observe(metadata.ttft_ms / 1000)
    if metadata.slot_wait_ms is not None:
        SLOT_WAIT.labels(tier).observe(metadata.slot_wait_ms / 1000)
    if metadata.residency_before != "unknown":
        LOOKUPS.labels(metadata.residency_before).inc()
    if metadata.identity_verified:
        IDENTITY.labels("verified").inc()
    source = metadata.residency_before
    for phase in ("fetch", "verify", "engine_load"):
        ms = getattr(metadata.load_ms, phase)
        if ms is not None:
            LOAD.labels(phase, source).observe(ms / 1000)
