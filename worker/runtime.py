"""Everything one worker process holds: engine, adapter cache, runner, job store, heartbeat."""

from __future__ import annotations

import json
import logging
import os
import socket
import threading
import time
from contextlib import ExitStack
from pathlib import Path

import boto3
from botocore.config import Config

from contracts.digests import manifest_of
from contracts.jobs import LoadTimings
from contracts.keys import WORKERS_INDEX, held_key, worker_key
from contracts.redis_policy import sync_client
from contracts.registry import AdapterRecord, BaseModelRef
from worker import metrics, model_card
from worker.adapter_cache import AdapterCache
from worker.background import Background
from worker.cancels import CancelWatcher
from worker.config import WorkerSettings
from worker.engine import ENGINE_VERSION, EngineHost, EngineOptions
from worker.errors import JobFailure, StopReason
from worker.held import HeldDeliveries
from worker.inflight import InFlight
from worker.job_store import JobStore
from worker.reaper import Reaper
from worker.registry import preload_sets
from worker.residency import EngineAdapters
from worker.runner import JobRunner
from worker.streams import DeltaPublisher

log = logging.getLogger(__name__)


def base_model_ref(model: str) -> BaseModelRef:
    """Id and content digest of the served base model (a local directory, or a hub snapshot)."""
    path = Path(model)
    if not path.is_dir():
        from huggingface_hub import snapshot_download

        path = Path(snapshot_download(model))
    return BaseModelRef(id=model, digest=manifest_of(path).digest())


def s3_client(settings: WorkerSettings) -> object:
    return boto3.client(
        "s3",
        endpoint_url=settings.s3_endpoint_url,
        region_name=settings.s3_region,
        config=Config(
            retries={"max_attempts": settings.s3_max_attempts, "mode": "standard"},
            connect_timeout=5,
            read_timeout=30,
        ),
    )


class WorkerRuntime:
    """Built once per worker process when Celery starts it; closed when Celery stops it."""

    def __init__(self, settings: WorkerSettings) -> None:
        self.settings = settings
        self.hostname = socket.gethostname()
        # Several workers may share a host: the announcement key needs the pid too.
        self.worker_id = f"{self.hostname}:{os.getpid()}"
        self.redis = sync_client(
            settings.redis_url, settings.redis_max_connections, decode_responses=True
        )
        self.jobs = JobStore(self.redis, settings.job_ttl_s)
        self.cache = AdapterCache(
            settings.cache_dir,
            s3_client(settings),
            settings.s3_bucket,
            max_bytes=settings.disk_cache_bytes,
            wait_s=settings.disk_wait_s,
            stream_attempts=settings.s3_max_attempts,
        )
        self.base_model = base_model_ref(settings.model)
        self.host = EngineHost(EngineOptions.from_settings(settings))
        self.adapters = EngineAdapters(self.host, self.cache, settings.max_loras)
        self.runner = JobRunner(
            self.host,
            self.cache,
            self.adapters,
            self.base_model,
            self.hostname,
            DeltaPublisher(self.redis),
        )
        self.inflight = InFlight()
        self.held = HeldDeliveries(self.redis, self.worker_id)
        self.metrics_port: int | None = None
        self.cancels = CancelWatcher(self.redis, self.jobs, self.inflight, settings.cancel_poll_s)
        self.reaper = Reaper(
            self.redis, settings.effective_broker_url, self.worker_id, settings.restore_interval_s
        )
        self._drain_timer: threading.Timer | None = None
        self.pinned: list[str] = []
        self.warm_preloaded: list[str] = []
        self._pinned_holds = ExitStack()
        self._heartbeat = Background(
            "heartbeat", self._beat, join_timeout_s=settings.heartbeat_s + 5
        )

    def start(self) -> None:
        """Check the slot budget, start the engine, preload hot and warm adapters."""
        self.held.start()
        hot, warm = preload_sets(self.redis, self.base_model.digest)
        if len(hot) >= self.settings.max_loras:
            raise RuntimeError(
                f"{len(hot)} hot adapters would take every GPU adapter slot (max_loras="
                f"{self.settings.max_loras}); at least one must stay free for other adapters. "
                "Raise LORAFLEET_MAX_LORAS or move adapters to the warm tier."
            )
        started = time.perf_counter()
        self.host.start()
        log.info("engine batch limits %s", self.host.batch_limits)
        log.info("engine ready in %.1f s", time.perf_counter() - started)
        if self.settings.colocate_engine_core:
            log.info("engine processes bound to cores %s", self.host.colocate_engine_core())
        card, tokenizer_json = model_card.describe(self.host.engine, self.base_model)
        model_card.publish(self.redis, card, tokenizer_json)
        self._preload(hot, warm)

    def announce(self) -> None:
        """Tell the fleet this worker consumes jobs; refreshed until ``close``."""
        self.metrics_port = metrics.serve(self.settings.metrics_port)
        log.info("metrics on port %d", self.metrics_port)
        self._announce()
        self._heartbeat.start()
        self.cancels.start()
        self.reaper.start()

    def begin_drain(self) -> None:
        """Shutdown began: running jobs get ``drain_timeout_s``, then are handed back."""
        if self._drain_timer is not None:
            return
        log.info(
            "draining: %d job(s) running, %.0f s to finish",
            len(self.inflight),
            self.settings.drain_timeout_s,
        )
        self._drain_timer = threading.Timer(self.settings.drain_timeout_s, self._drain_expired)
        self._drain_timer.daemon = True
        self._drain_timer.start()

    def _drain_expired(self) -> None:
        stopped = self.inflight.stop_all(StopReason.DRAIN)
        log.warning("drain timeout passed: handing %d running job(s) back to the queue", stopped)

    def _preload(self, hot: list[AdapterRecord], warm: list[AdapterRecord]) -> None:
        """Pin hot adapters in GPU slots; register warm ones in the engine's CPU cache."""
        for record in hot:
            self._pinned_holds.enter_context(self.cache.hold(record.digest))
            try:
                resident = self.adapters.pin(record.alias, record.digest)
            except JobFailure as failure:
                log.error("hot adapter %s not pinned: %s", record.alias, failure.message)
                continue
            self.pinned.append(resident.request.lora_name)
        room = self.settings.max_cpu_loras - len(self.pinned)
        for record in warm[: max(room, 0)]:
            try:
                with self.cache.hold(record.digest):
                    resident = self.adapters.make_resident(
                        record.alias, record.digest, LoadTimings(), self.adapters.registered()
                    )
            except JobFailure as failure:
                log.error("warm adapter %s not preloaded: %s", record.alias, failure.message)
                continue
            self.warm_preloaded.append(resident.request.lora_name)
        metrics.RESIDENT.labels("gpu").set(len(self.pinned))
        log.info("pinned %s; warm preloaded %s", self.pinned, self.warm_preloaded)

    def _announce(self) -> None:
        record = {
            "worker_id": self.worker_id,
            "hostname": self.hostname,
            "base_model": self.base_model.model_dump(),
            "engine_version": ENGINE_VERSION,
            "max_loras": self.settings.max_loras,
            "max_cpu_loras": self.settings.max_cpu_loras,
            **self.host.batch_limits,
            "pinned": self.pinned,
            "warm_preloaded": self.warm_preloaded,
            "disk_cache_bytes": self.cache.used_bytes(),
            "engine_unfinished_requests": self._unfinished_requests(),
            "jobs_running": len(self.inflight),
            "engine_aborted_requests": self.runner.aborted_requests,
            "disk_cache_max_bytes": self.cache.max_bytes,
            "metrics_port": self.metrics_port,
            "queues": self.settings.queues.split(","),
            "concurrency": self.settings.worker_concurrency,
            "seen_at": time.time(),
        }
        self.redis.set(
            worker_key(self.worker_id), json.dumps(record), ex=self.settings.announcement_ttl_s
        )
        self.redis.sadd(WORKERS_INDEX, self.worker_id)

    def _unfinished_requests(self) -> int | None:
        # Asked on the engine loop; a loop too busy to answer must not delay the heartbeat
        # (a late heartbeat makes the fleet think this worker died).
        try:
            return self.host.unfinished_requests(timeout_s=min(1.0, self.settings.heartbeat_s))
        except TimeoutError:
            return None

    def _beat(self, stopping: threading.Event) -> None:
        while not stopping.wait(self.settings.heartbeat_s):
            try:
                self._announce()
            except Exception as exc:  # a Redis outage must not kill the heartbeat thread
                log.warning("heartbeat failed: %s", exc)

    def close(self) -> None:
        """Stop the heartbeat, withdraw the announcement, shut the engine down."""
        self._heartbeat.close()
        if self._drain_timer is not None:
            self._drain_timer.cancel()
        self.cancels.close()
        self.reaper.close()
        self.held.close()
        try:
            # Anything still held was handed back by the drain or by kombu at shutdown.
            self.redis.delete(worker_key(self.worker_id), held_key(self.worker_id))
            self.redis.srem(WORKERS_INDEX, self.worker_id)
        except Exception as exc:
            log.warning("could not withdraw worker record: %s", exc)
        self.host.shutdown()
        self._pinned_holds.close()
