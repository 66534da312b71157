"""Everything one worker process holds: engine, adapter cache, runner, job store, heartbeat.

A worker whose engine fails (its core died, or it stopped answering: ``worker.watchdog``)
must not keep taking jobs from a shared queue and failing them in milliseconds. It stops
consuming, hands every job it holds back to its queue (running ones uncounted, unstarted
ones untouched), withdraws its readiness, reports the failure, and exits with
``EXIT_ENGINE_FAILED`` so that its orchestrator restarts it.
"""

from __future__ import annotations

import json
import logging
import os
import socket
import threading
import time
import uuid
from pathlib import Path
from typing import Any

import sentry_sdk
from celery.worker import state as celery_state

from contracts.digests import manifest_of
from contracts.jobs import JobMessage, LoadTimings
from contracts.keys import STREAM_TTL_S, WORKER_QUEUES, WORKERS_INDEX, held_key, worker_key
from contracts.queues import Tier, pool_queues
from contracts.redis_policy import sync_client
from contracts.registry import AdapterRecord, BaseModelRef
from contracts.routing import worker_queue
from worker import metrics, model_card
from worker.adapter_cache import AdapterCache
from worker.background import Background
from worker.cancels import CancelWatcher
from worker.config import WorkerSettings
from worker.engine import ENGINE_VERSION, EngineFailed, EngineHost, EngineOptions
from worker.errors import JobFailure, StopReason
from worker.held import HeldDeliveries
from worker.inflight import InFlight
from worker.job_store import JobStore
from worker.leases import LeaseKeeper
from worker.object_store import s3_client
from worker.pins import Pins
from worker.prefetch import NoPrefetch, Prefetcher
from worker.reaper import QueueKeeper, Reaper, hand_back
from worker.registry import preload_sets, record_pools
from worker.residency import EngineAdapters
from worker.result_store import ResultStore, results_client
from worker.runner import JobRunner
from worker.script_batch import ScriptBatch, script_client
from worker.streams import DeltaPublisher
from worker.sweeper import DeadlineSweeper
from worker.watchdog import EngineWatch

log = logging.getLogger(__name__)

EXIT_ENGINE_FAILED = 75
"""Exit status of a worker whose engine failed (``EX_TEMPFAIL``: restart me)."""

PUBLISH_GATHER_S = 0.2
"""Adapter changes are published this long after the first of them, together."""

STOP_CONSUMING_S = 5.0
"""How long the consumer thread gets to cancel its queues before jobs are handed back anyway
(it runs pending operations between waits for messages of up to 2 s)."""


def new_worker_id(hostname: str) -> str:
    """``host:pid:boot``. The boot id tells a restarted process from its predecessor: in a
    container restarted in its pod, host and pid (1) are the same again."""
    return f"{hostname}:{os.getpid()}:{uuid.uuid4().hex[:8]}"


def base_model_ref(model: str) -> BaseModelRef:
    """Id and content digest of the served base model (a local directory, or a hub snapshot)."""
    path = Path(model)
    if not path.is_dir():
        from huggingface_hub import snapshot_download

        path = Path(snapshot_download(model))
    return BaseModelRef(id=model, digest=manifest_of(path).digest())


class WorkerRuntime:
    """Built once per worker process when Celery starts it; closed when Celery stops it."""

    def __init__(self, settings: WorkerSettings) -> None:
        self.settings = settings
        self.hostname = socket.gethostname()
        self.worker_id = new_worker_id(self.hostname)
        self.queue = worker_queue(self.worker_id)
        """This worker's own queue: jobs the gateways route to it (``contracts.routing``)."""
        self.redis = sync_client(
            settings.redis_url, settings.redis_max_connections, decode_responses=True
        )
        self.scripts = ScriptBatch(script_client(settings.redis_url))
        self.jobs = JobStore(
            self.redis,
            settings.job_ttl_s,
            self.worker_id,
            settings.lease_ttl_s,
            batch=self.scripts,
        )
        self.results = ResultStore(
            results_client(settings), settings.s3_bucket, settings.result_offload_bytes
        )
        self.cache = AdapterCache(
            settings.cache_dir,
            s3_client(settings),
            settings.s3_bucket,
            max_bytes=settings.disk_cache_bytes,
            wait_s=settings.disk_wait_s,
            # Tries of a body that breaks mid-read: the first and the setting's retries.
            stream_attempts=settings.s3_max_attempts + 1,
            policy=settings.disk_eviction,
            rate_half_life_s=settings.disk_rate_half_life_s,
        )
        self.base_model = base_model_ref(settings.model)
        self.pool_queues = pool_queues(self.base_model.digest, settings.tier_list)
        """The shared queues of this worker's pool that it takes from (its tiers' for its base
        model, ``contracts.queues.queue_for``)."""
        self.host = EngineHost(EngineOptions.from_settings(settings))
        self.host.on_failure(self._engine_failed)
        self.adapters = EngineAdapters(
            self.host,
            self.cache,
            settings.max_loras,
            max_cpu_loras=settings.max_cpu_loras,
            slot_drain_after_s=settings.slot_drain_after_s,
        )
        self.prefetcher: Prefetcher | NoPrefetch = NoPrefetch()
        if settings.prediction != "off":
            self.prefetcher = Prefetcher(
                self.redis,
                self.adapters,
                self.cache,
                self.base_model.digest,
                [self.queue, *self.pool_queues],  # jobs routed here first
                settings.lookahead_jobs,
                settings.prefetch_interval_s,
                popularity=settings.popularity_prefetch
                if settings.prediction == "popularity"
                else 0,
                popularity_check_s=settings.popularity_check_s,
                engine_version=ENGINE_VERSION,
            )
        self.deltas = DeltaPublisher(
            self.redis,
            self.worker_id,
            settings.lease_ttl_s,
            self.jobs.note_outage,
            stream_ttl_s=min(STREAM_TTL_S, settings.job_ttl_s),
        )
        self.runner = JobRunner(
            self.host,
            self.cache,
            self.adapters,
            self.base_model,
            self.hostname,
            self.deltas,
            self.prefetcher.found,
            self.prefetcher.counted_ahead,
        )
        self.inflight = InFlight()
        self.held = HeldDeliveries(self.redis, self.worker_id)
        self.metrics_port: int | None = None
        self.cancels = CancelWatcher(self.redis, self.jobs, self.inflight, settings.cancel_poll_s)
        self.reaper = Reaper(
            self.redis, settings.effective_broker_url, self.worker_id, settings.restore_interval_s
        )
        self.queue_keeper = QueueKeeper(
            self.redis,
            min(settings.restore_interval_s, settings.route_max_wait_s / 2),
            settings.route_max_wait_s,
        )
        self.leases = LeaseKeeper(
            self.redis,
            self.worker_id,
            self.inflight,
            settings.lease_ttl_s,
            settings.lease_refresh_s,
            self.jobs.note_outage,
        )
        self.watch = EngineWatch(
            self.host,
            settings.engine_check_s,
            settings.engine_probe_s,
            settings.engine_probe_timeout_s,
        )
        self.sweeper = DeadlineSweeper(
            self.redis,
            self.jobs,
            self.worker_id,
            settings.sweep_interval_s,
            settings.sweep_grace_s,
        )
        self._consumer: Any = None
        self._announced = False
        self._draining = False
        self._consuming_stopped = threading.Event()
        self._deadline_warned_at = -float("inf")
        self._drain_timer: threading.Timer | None = None
        self.warm_preloaded: list[str] = []
        self._heartbeat = Background(
            "heartbeat", self._beat, join_timeout_s=settings.heartbeat_s + 5
        )
        # Routing wants to know soon when this worker's adapters change.
        self._residency_changed = threading.Event()
        self.adapters.on_change = self._residency_changed.set
        self.cache.on_change = self._residency_changed.set
        self._engine_levels: dict[str, str] = {}
        self._published_levels: dict[str, str] | None = None
        self._announcing = threading.Lock()
        self.pins = Pins(
            self.redis,
            self.adapters,
            self.cache,
            self.base_model.digest,
            Tier.HOT in settings.tier_list,
            settings.max_loras,
            settings.pin_check_s,
            self._residency_changed.set,
        )

    def start(self) -> None:
        """Check the slot budget, start the engine, preload hot and warm adapters."""
        self.scripts.start()
        self.held.start()
        self.deltas.start()
        # Hot adapters are pinned by the workers that take the hot tier, warm ones preloaded
        # by those that take the warm tier: jobs of other tiers never reach this worker.
        hot, beyond = self.pins.desired()
        _, warm = preload_sets(self.redis, self.base_model.digest)
        warm = warm if Tier.WARM in self.settings.tier_list else []
        if beyond:
            # Publishing refuses this while a worker of the pool is up (pins_exceed_slots); one
            # that starts against such a registry serves the rest unpinned, never crash-loops.
            log.error(
                "%d hot adapters, %d GPU slots to pin them (LORAFLEET_MAX_LORAS=%d, one stays "
                "free): not pinning %s (preloaded warm, served like any other adapter); raise "
                "LORAFLEET_MAX_LORAS or retire hot adapters",
                len(hot) + len(beyond),
                len(hot),
                self.settings.max_loras,
                ", ".join(record.alias for record in beyond),
            )
            warm = [*beyond, *warm]
        started = time.perf_counter()
        self.host.start()
        log.info("engine batch limits %s", self.host.batch_limits)
        log.info("engine ready in %.1f s", time.perf_counter() - started)
        if self.settings.colocate_engine_core:
            log.info("engine processes bound to cores %s", self.host.colocate_engine_core())
        card, tokenizer_json = model_card.describe(self.host.engine, self.base_model)
        model_card.publish(self.redis, card, tokenizer_json)
        record_pools(self.redis, self.base_model)
        self._preload(hot, warm)
        warmed = self.prefetcher.warm_up(self.settings.warmup_timeout_s)
        if warmed:
            log.info("warmed up %d popular adapter(s) before taking jobs", warmed)
        self.watch.start()

    def announce(self, consumer: Any) -> None:
        """Tell the fleet this worker consumes jobs (``consumer``: Celery's, now running);
        refreshed until ``close``."""
        self._consumer = consumer
        self.metrics_port = metrics.serve(self.settings.metrics_port, self.ready, self.live)
        log.info("metrics on port %d", self.metrics_port)
        self._announced = True
        self._announce()
        self._heartbeat.start()
        self.cancels.start()
        self.reaper.start()
        self.queue_keeper.start()
        self.pins.start()
        self.prefetcher.start()
        self.leases.start()
        self.sweeper.start()

    def ready(self) -> bool:
        """Readiness: taking jobs (announced, not draining, engine serving)."""
        return self._announced and not self._draining and not self.failed

    def live(self) -> bool:
        """Liveness: false once the engine failed (the worker is on its way out)."""
        return not self.failed

    @property
    def failed(self) -> bool:
        """The engine failed: nothing more runs here."""
        return self.host.failure is not None

    def received(self, request: Any) -> None:
        """In the consumer thread, as a message arrives: record the delivery, and give the
        task its delivery tag (Celery's task context carries no tag of its own)."""
        tag = str(request.message.delivery_tag)
        request.delivery_info["delivery_tag"] = tag
        self.held.received(tag, request.id)

    def check_deadline_span(self, message: JobMessage) -> None:
        """Say loudly when a job's deadline outlasts what this worker's visibility timeout
        covers: Redis would then hand it to a second worker while it runs (that delivery
        waits for the lease, but the settings are wrong)."""
        span = message.deadline_at - message.accepted_at
        if self.settings.covers(span):
            return
        metrics.DEADLINE_BEYOND_VISIBILITY.inc()
        if time.monotonic() - self._deadline_warned_at > 60:
            self._deadline_warned_at = time.monotonic()
            log.error(
                "job %s has a %.0f s deadline but LORAFLEET_VISIBILITY_TIMEOUT_S=%d covers %.0f "
                "s (timeout - heartbeat expiry - restore interval): raise the visibility "
                "timeout above the gateway's LORAFLEET_JOB_DEADLINE_S + %d s",
                message.job_id,
                span,
                self.settings.visibility_timeout_s,
                self.settings.safe_deadline_s,
                self.settings.announcement_ttl_s + round(self.settings.restore_interval_s),
            )

    def _engine_failed(self, reason: str) -> None:
        """The engine failed (called once, from whichever thread saw it first)."""
        metrics.ENGINE_FAILURES.inc()
        if self._draining:
            # Shutting down: a signal to the whole process group stops the engine core too.
            log.warning("engine stopped during shutdown: %s", reason)
        else:
            with sentry_sdk.new_scope() as scope:
                scope.set_tag("worker", self.worker_id)
                sentry_sdk.capture_message(f"engine failed: {reason}", level="fatal")
        self.inflight.stop_all(StopReason.ENGINE_FAILED)
        threading.Thread(target=self._leave, name="engine-failed", daemon=True).start()

    def _leave(self) -> None:
        """Stop consuming, let every job hand itself back, then exit non-zero."""
        self._stop_consuming()
        # The fleet sees the failure at once, before the record goes; routed jobs go back.
        self._withdraw_queue()
        bound = time.monotonic() + self.settings.engine_failure_exit_s / 2
        while len(self.inflight) and time.monotonic() < bound:
            time.sleep(0.05)
        log.critical(
            "engine failed; %d job(s) still running; exiting with %d",
            len(self.inflight),
            EXIT_ENGINE_FAILED,
        )
        # Celery's own warm shutdown: it waits for the pool, whose tasks hand their jobs back.
        celery_state.should_stop = EXIT_ENGINE_FAILED
        backstop = threading.Timer(
            self.settings.engine_failure_exit_s / 2, os._exit, args=(EXIT_ENGINE_FAILED,)
        )
        backstop.daemon = True
        backstop.start()

    def _stop_consuming(self) -> None:
        consumer = self._consumer

        def cancel_queues() -> None:
            for queue in list(consumer.task_consumer.queues):
                consumer.cancel_task_queue(queue.name)
            self._consuming_stopped.set()

        if consumer is not None:
            # Consumer state belongs to the consumer thread: it runs this between its waits.
            consumer.call_soon(cancel_queues)
            if not self._consuming_stopped.wait(STOP_CONSUMING_S):
                log.error("the consumer did not stop within %.0f s", STOP_CONSUMING_S)
        self._consuming_stopped.set()

    def consumption_stopped(self, timeout_s: float) -> bool:
        """Wait until this worker takes no more jobs (its engine failed)."""
        return self._consuming_stopped.wait(timeout_s)

    def begin_drain(self) -> None:
        """Shutdown began: running jobs get ``drain_timeout_s``, then are handed back; jobs
        routed to this worker's own queue go back to the shared queues at once."""
        self._draining = True
        if self._drain_timer is not None:
            return
        threading.Thread(target=self._withdraw_queue, name="drain-queue", daemon=True).start()
        log.info(
            "draining: %d job(s) running, %.0f s to finish",
            len(self.inflight),
            self.settings.drain_timeout_s,
        )
        self._drain_timer = threading.Timer(self.settings.drain_timeout_s, self._drain_expired)
        self._drain_timer.daemon = True
        self._drain_timer.start()

    def _withdraw_queue(self) -> None:
        """Say this worker takes no more routed jobs (its announcement's state), then hand
        back what its own queue holds. A job a gateway routes here from an older view of the
        fleet is handed back by the fleet's queue keepers."""
        try:
            if self._announced:
                self._announce()
            moved = hand_back(self.redis, self.worker_id)
        except Exception as exc:
            log.warning("could not hand back this worker's own queue: %s", exc)
        else:
            if moved:
                log.info("%d routed job(s) back to the shared queues", moved)

    def _drain_expired(self) -> None:
        stopped = self.inflight.stop_all(StopReason.DRAIN)
        log.warning("drain timeout passed: handing %d running job(s) back to the queue", stopped)

    def _preload(self, hot: list[AdapterRecord], warm: list[AdapterRecord]) -> None:
        """Pin hot adapters in GPU slots; register warm ones in the engine's CPU cache."""
        self.pins.pin_at_start(hot)
        room = self.settings.max_cpu_loras - len(self.pins.names)
        for record in warm[: max(room, 0)]:
            try:
                with self.cache.hold(record.digest):
                    resident = self.adapters.make_resident(
                        record.alias, record.digest, LoadTimings()
                    )
            except JobFailure as failure:
                log.error("warm adapter %s not preloaded: %s", record.alias, failure.message)
                continue
            self.warm_preloaded.append(resident.request.lora_name)
        log.info("pinned %s; warm preloaded %s", self.pins.names, self.warm_preloaded)

    def _announce(self, ask_engine: bool = True) -> bool:
        """Write this worker's record (with the adapters it holds: the engine asked now, or
        its last answer); one writer at a time, its state read just before the write, so a
        heartbeat never puts back "serving" over "draining". False if nothing changed since
        the last write and ``ask_engine`` is false (a change signal with nothing to say)."""
        adapters = self._adapter_levels(ask_engine)
        with self._announcing:
            if not ask_engine and adapters == self._published_levels:
                return False
            self._published_levels = adapters
            self._write_announcement(adapters)
        return True

    def _write_announcement(self, adapters: dict[str, str]) -> None:
        state = "failed" if self.failed else "draining" if self._draining else "serving"
        record = {
            "worker_id": self.worker_id,
            "hostname": self.hostname,
            "pid": os.getpid(),
            # The Celery node name up to the '@' (``worker`` of ``worker@host``).
            "node": str(getattr(self._consumer, "hostname", "")).split("@", 1)[0],
            "state": state,
            "base_model": self.base_model.model_dump(),
            "engine_version": ENGINE_VERSION,
            "max_loras": self.settings.max_loras,
            "max_cpu_loras": self.settings.max_cpu_loras,
            **self.host.batch_limits,
            "pinned": self.pins.names,
            "warm_preloaded": self.warm_preloaded,
            "disk_cache_bytes": self.cache.used_bytes(),
            "engine_unfinished_requests": self._unfinished_requests(),
            "jobs_running": len(self.inflight),
            "engine_aborted_requests": self.runner.aborted_requests,
            "disk_cache_max_bytes": self.cache.max_bytes,
            "metrics_port": self.metrics_port,
            "queues": self.pool_queues,
            "queue": self.queue,
            "adapters": adapters,
            "concurrency": self.settings.worker_concurrency,
            "seen_at": time.time(),
        }
        pipe = self.redis.pipeline(transaction=False)
        pipe.set(
            worker_key(self.worker_id), json.dumps(record), ex=self.settings.announcement_ttl_s
        )
        pipe.sadd(WORKERS_INDEX, self.worker_id)
        if state == "serving":
            pipe.zadd(WORKER_QUEUES, {self.worker_id: time.time()})
        pipe.execute()

    def _adapter_levels(self, ask_engine: bool = True) -> dict[str, str]:
        """Digest -> ``pinned``, ``engine`` or ``disk`` of every adapter held here, for routing
        (the engine's last answer if it is not asked, or too busy to give one now)."""
        levels = dict.fromkeys(self.cache.digests(), "disk")
        if ask_engine and not self.failed:
            engine = self.adapters.levels(timeout_s=min(0.5, self.settings.residency_publish_s))
            if engine is not None:
                self._engine_levels = engine
                self.adapters.prune(timeout_s=min(0.5, self.settings.residency_publish_s))
        levels.update(self._engine_levels)
        return levels

    def _unfinished_requests(self) -> int | None:
        # Asked on the engine loop; a loop too busy to answer must not delay the heartbeat
        # (a late heartbeat makes the fleet think this worker died).
        try:
            return self.host.unfinished_requests(timeout_s=min(1.0, self.settings.heartbeat_s))
        except (TimeoutError, EngineFailed):
            return None

    def _beat(self, stopping: threading.Event) -> None:
        """Announce every ``residency_publish_s`` (at most the heartbeat period), and soon
        after the adapters held here changed (changes within ``PUBLISH_GATHER_S`` make one)."""
        period = min(self.settings.heartbeat_s, self.settings.residency_publish_s)
        due = time.monotonic() + period
        while not stopping.is_set():
            changed = self._residency_changed.wait(max(0.0, due - time.monotonic()))
            if changed and stopping.wait(PUBLISH_GATHER_S):
                return
            self._residency_changed.clear()
            if stopping.is_set():
                return
            # The engine's set changes with nearly every request on a busy worker: a change
            # between two periodic announcements publishes what the disk holds now and the
            # engine's last answer (no question to the engine), and only if that differs.
            periodic = time.monotonic() >= due
            if periodic:
                due = time.monotonic() + period
            try:
                self._announce(ask_engine=periodic)
            except Exception as exc:  # a Redis outage must not kill the heartbeat thread
                self.jobs.note_outage()
                log.warning("heartbeat failed: %s", exc)

    def close(self) -> None:
        """Stop the heartbeat, withdraw the announcement, shut the engine down."""
        self._heartbeat.close()
        if self._drain_timer is not None:
            self._drain_timer.cancel()
        self.watch.close()
        self.sweeper.close()
        self.leases.close()
        self.cancels.close()
        self.reaper.close()
        self.queue_keeper.close()
        self.pins.close()
        self.prefetcher.close()
        self.deltas.close()
        self.held.close()
        self.scripts.close()
        try:
            # Anything still held was handed back by the drain or by kombu at shutdown.
            self.redis.delete(worker_key(self.worker_id), held_key(self.worker_id))
            self.redis.srem(WORKERS_INDEX, self.worker_id)
        except Exception as exc:
            log.warning("could not withdraw worker record: %s", exc)
        self.host.shutdown()
        self.cache.close()
