"""The Celery app of the worker (``celery -A worker.celery_app worker``). Kept tiny.

All delivery settings live here, together, each with the reason it is set. The guarantees
they add up to (README, "Delivery guarantees"):

- at least once: a job is acknowledged only after its outcome is stored; a worker that dies
  mid-job never acknowledges, and another worker's reaper (``worker.reaper``) puts its jobs
  back on their queues once its heartbeat expired; as a backstop, Redis hands out anything
  unacknowledged for ``visibility_timeout_s`` (both checked every ``restore_interval_s``);
- never twice at once: every job ends (or fails ``deadline_exceeded``) by its deadline, and
  ``visibility_timeout_s`` exceeds deadline + heartbeat expiry + restore interval, so a live
  worker always acknowledges a job before Redis would redeliver it;
- effects once: every record change is a compare-and-set (``contracts.job_records``);
- a job that kills its worker every time stops after ``max_attempts`` starts;
- SIGTERM drains: no new jobs, running ones get ``drain_timeout_s`` to finish, then are aborted
  and handed back to the queue; unstarted prefetched jobs go back to the queue at once;
- a failed engine (``worker.watchdog``) is a drain that cannot wait: the worker stops
  consuming, hands every job back, and exits non-zero (``worker.runtime``);
- a delivery of a job whose other attempt is alive (a reaper or a reconnect handed the
  message back early) waits for that attempt's lease instead of running it twice.
"""

from __future__ import annotations

import contextlib
import functools
import logging
import sys
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from typing import Any, NoReturn

import vllm.envs
from celery import Celery
from celery.signals import (
    celeryd_after_setup,
    task_received,
    worker_init,
    worker_ready,
    worker_shutdown,
    worker_shutting_down,
)
from kombu import Queue
from kombu.transport.redis import Channel as RedisChannel
from redis.exceptions import ConnectionError as RedisConnectionError

from contracts.queues import QUEUE_PREFIX
from contracts.telemetry import sentry_options
from contracts.warm_process import freeze_heap, start_threads, thaw_heap
from worker import metrics
from worker.config import get_settings
from worker.runtime import WorkerRuntime

log = logging.getLogger(__name__)
settings = get_settings()
# Celery logs two INFO lines per task ("received", "succeeded in"): 0.8 ms of a worker's CPU
# per job, measured (benchmarks/short_jobs.py), for what job records and metrics say better.
# Its warnings and errors, and every line of lorafleet's own, are still logged.
for _per_task in ("celery.app.trace", "celery.worker.strategy"):
    logging.getLogger(_per_task).setLevel(logging.WARNING)
GIL_SWITCH_INTERVAL_S = 0.0005
WARM_THREADS_S = 10.0
"""How long the job threads may take to start before the worker announces itself anyway."""

app = Celery("lorafleet", broker=settings.effective_broker_url, include=["worker.tasks"])
app.conf.update(
    # Acknowledge only after the task returned (result stored): a crash mid-job redelivers it.
    task_acks_late=True,
    # Prefork pools: a task whose child process died goes back to the queue. (With the
    # threads pool the whole worker dies; the reaper of another worker restores its jobs.)
    task_reject_on_worker_lost=True,
    broker_transport_options={
        # Unacked jobs return to the queue this long after delivery: longer than any job
        # can run (its deadline), so only a dead worker's jobs come back.
        "visibility_timeout": settings.visibility_timeout_s,
        # Every worker looks for such jobs this often (kombu's default is a scan every
        # 10 x 10 s; a dead worker's jobs should not wait that long).
        "unacked_restore_interval": settings.restore_interval_s,
        "unacked_restore_throttle": 1,
    },
    # Jobs reserved per pool thread: with 1, a busy worker cannot hoard a queue.
    worker_prefetch_multiplier=settings.prefetch_multiplier,
    # Results live in our own job records (contracts.keys.job_key), not Celery's backend.
    task_ignore_result=True,
    # Replaced at start-up by the worker's own queues (``_consume_pool_queues``); never
    # consumed, never published to.
    task_default_queue=f"{QUEUE_PREFIX}unselected",
    broker_connection_retry_on_startup=True,
    worker_hijack_root_logger=False,
)
if settings.receive_batch > 1 and settings.effective_broker_url.startswith(("redis:", "rediss:")):
    # kombu's Redis transport, receiving in batches (``worker.receive``): one script records a
    # BRPOP's message and takes the queue's next few. The records it keeps are kombu's own, so
    # whatever reads them (kombu's acks and restores, ``worker.reaper``) is unchanged. Plain
    # Redis URLs only: a given transport overrides the URL's scheme, and ``sentinel://``
    # needs kombu's Sentinel transport (which then reads one message at a time).
    app.conf.broker_transport = "worker.receive:Transport"
    # Read by ``worker.receive``: how many jobs one receipt may take.
    app.conf.broker_transport_options["receive_batch"] = settings.receive_batch


def _refuse_when_detached(original: Any) -> Any:
    """kombu 5.7 / Celery 5.7: when Redis goes away, Celery collects the broken connection (its
    transport forgets its client) while jobs still run. Everything the old channel then does
    through that forgotten client (put its unacknowledged deliveries back as it closes, ack a
    job that finishes after the reconnect) raises ``AttributeError``, which Celery takes for
    unrecoverable: the worker exits. Raised as the connection error it is, Celery and kombu
    handle it: the deliveries stay where they are (the jobs store their outcome once Redis is
    back) until the visibility timeout returns them, as duplicates of finished jobs that a
    worker drops; none is handed to a second worker while its job runs."""

    @functools.wraps(original)
    def _connparams(self: Any, asynchronous: bool = False) -> Any:
        if self.connection is None or self.connection.client is None:
            raise RedisConnectionError("this broker channel's connection is gone")
        return original(self, asynchronous=asynchronous)

    return _connparams


RedisChannel._connparams = _refuse_when_detached(RedisChannel._connparams)  # type: ignore[method-assign]


@contextlib.contextmanager
def _one_client_per_pool(self: Any, client: Any = None) -> Iterator[Any]:
    """kombu's Redis channel builds a new ``redis.Redis`` (setting up its hundreds of reply
    callbacks) for every receipt and every ack; measured at 7% of a busy worker's Python
    time. One client per connection pool serves them all: a client is thread-safe, each
    command takes a connection from the pool. The pool is looked up as kombu looks it up,
    so a channel whose connection is gone still raises where it did (``_connparams``)."""
    if client:
        yield client
        return
    pool = self.pool
    shared = self.__dict__.get("_lorafleet_client")
    if shared is None or shared.connection_pool is not pool:
        shared = self.__dict__["_lorafleet_client"] = self._create_client()
    yield shared


RedisChannel.conn_or_acquire = _one_client_per_pool  # type: ignore[method-assign,assignment]

_runtime: WorkerRuntime | None = None


def runtime() -> WorkerRuntime:
    """The process's runtime; exists from ``worker_init`` until ``worker_shutdown``."""
    if _runtime is None:
        raise RuntimeError("the worker runtime is not started")
    return _runtime


@worker_init.connect
def _start_runtime(**_: Any) -> None:
    global _runtime
    # One consumer thread receives every job while pool threads and the engine loop keep the
    # GIL busy; each Redis round trip it makes costs a GIL hand-off, by default up to 5 ms.
    # With 0.5 ms it receives messages ~10x faster (benchmarks/throughput.py).
    sys.setswitchinterval(GIL_SWITCH_INTERVAL_S)
    # Celery swallows exceptions from signal handlers (and its logging is not set up yet, so
    # they go unseen): a worker without its runtime would run on "ready", taking nothing, for
    # ever. Every failure here leaves for real, its cause logged.
    try:
        if settings.sentry_dsn:
            import sentry_sdk

            sentry_sdk.init(dsn=settings.sentry_dsn, **sentry_options())
        candidate = WorkerRuntime(settings)
    except Exception:
        _leave("worker runtime could not be built")
    try:
        candidate.start()
    except Exception:
        _leave("worker runtime failed to start", candidate)
    _runtime = candidate


def _leave(why: str, started: WorkerRuntime | None = None) -> NoReturn:
    """Exit 1 from a signal handler, logging ``why`` with the exception being handled (before
    Celery sets up logging, Python's last-resort handler writes it to stderr), after closing
    what of the runtime ``started`` (a failure to close is logged, and changes nothing)."""
    log.exception(why)
    if started is not None:
        try:
            started.close()
        except Exception:
            log.exception("closing the worker runtime failed too")
    raise SystemExit(1) from None


@celeryd_after_setup.connect
def _consume_pool_queues(instance: Any, **_: Any) -> None:
    # The queues follow from the base model (hashed at start-up) and LORAFLEET_TIERS: the
    # pool queues of this worker's tiers, and its own queue for the jobs the gateways route to
    # it. The own queue is never declared: nothing publishes to it through an exchange (the
    # admission script pushes onto the list), and a declaration would leave a binding key
    # behind for every worker that ever ran. ``select`` replaces the default queue's selection.
    if _runtime is not None:
        queues = instance.app.amqp.queues
        queues.select_add(Queue(_runtime.queue, no_declare=True))
        queues.select([*_runtime.pool_queues, _runtime.queue])
        log.info("consuming %s", ", ".join([*_runtime.pool_queues, _runtime.queue]))


@worker_ready.connect
def _announce(sender: Any, **_: Any) -> None:
    # Only now does the consumer (and its remote-control mailbox) run: announce readiness here,
    # not when the engine is up, so "ready" means "taking jobs". The sender is the consumer.
    # A worker that could not announce itself would take jobs without its heartbeat, lease
    # keeper or reaper (Celery swallows the exception): it leaves, and the runtime is closed
    # on the way out (``worker_shutdown``).
    # Warm first (this thread receives no job meanwhile), so that "ready" also means "warm".
    # Only a speed-up: a worker that could not warm serves all the same.
    try:
        _warm(sender.pool)
    except Exception:
        log.exception("worker not warmed ahead")
    try:
        runtime().announce(sender)
    except Exception:
        _leave("worker could not announce itself")


def _warm(pool: Any) -> None:
    """Ready for the first burst (``contracts.warm_process``): the pool's job threads started
    (the threads pool's executor; another pool is left as it is), vLLM's environment read once
    for good, then the heap as it stands frozen, the engine's included.

    vLLM's frontend, on the engine loop, reads an environment variable through ``os.environ``
    for every output of every request (``IterationStats.update_from_output``); its engine
    core caches them once started (``enable_envs_cache``), its API server does not. Cached
    here the same way: nothing in this process changes the environment after start-up."""
    executor = getattr(pool, "executor", None)
    if isinstance(executor, ThreadPoolExecutor):
        try:
            start_threads(executor, pool.limit, timeout_s=WARM_THREADS_S)
            log.info("%d job threads started", pool.limit)
        except Exception as exc:  # they start with the first jobs instead
            log.warning("job threads not started ahead: %s", exc)
    try:  # every variable is read now: a value vLLM refuses raises here
        vllm.envs.enable_envs_cache()
        log.info("vLLM's environment variables read once and cached")
    except Exception as exc:
        vllm.envs.disable_envs_cache()
        log.warning("vLLM's environment not cached: %s", exc)
    frozen = freeze_heap()
    metrics.HEAP_FROZEN.set(frozen)
    log.info("%d objects of the start-up heap frozen", frozen)


@task_received.connect
def _note_delivery(request: Any, **_: Any) -> None:
    # In the consumer thread, as the message arrives: record its broker delivery tag, so a
    # reaper can hand it back if this worker dies (written off this thread: no Redis wait).
    if _runtime is not None:
        _runtime.received(request)


@worker_shutting_down.connect
def _drain(**_: Any) -> None:
    # Sent from the signal handler (SIGTERM): Celery stops consuming and waits for running
    # jobs; the runtime bounds that wait by the drain timeout.
    if _runtime is not None:
        _runtime.begin_drain()


@worker_shutdown.connect
def _stop_runtime(**_: Any) -> None:
    # vLLM's engine-core child processes keep the worker alive on SIGTERM unless the engine
    # is shut down explicitly.
    global _runtime
    try:
        if _runtime is not None:
            _runtime.close()
            _runtime = None
    finally:
        thaw_heap()
