"""What the soak watches while it runs: each service process's resident memory, Redis's memory
and key count, and every job record's status (so a job nobody asked about is still checked).
All of it sampled on a thread of its own, off the traffic's event loop."""

from __future__ import annotations

import contextlib
import threading
from collections.abc import Callable
from dataclasses import dataclass, field

import psutil
from redis import Redis
from redis.exceptions import RedisError

from contracts.keys import PREFIX
from lorafleet.stack import LocalStack

JOB_PATTERN = f"{PREFIX}:job:*"
TERMINAL = ("succeeded", "failed", "cancelled")


@dataclass
class Series:
    """Samples ``(seconds since the run began, value)`` of one process instance."""

    role: str
    name: str
    pid: int
    points: list[tuple[float, float]] = field(default_factory=list)

    def slope_per_h(self, skip_share: float = 0.25) -> float | None:
        """Least-squares slope in units per hour over the samples after the first
        ``skip_share`` of the process's life (start-up allocation is not growth); ``None``
        with fewer than 6 samples left."""
        if not self.points:
            return None
        began, ended = self.points[0][0], self.points[-1][0]
        kept = [p for p in self.points if p[0] >= began + (ended - began) * skip_share]
        if len(kept) < 6:
            return None
        n = len(kept)
        mean_t = sum(t for t, _ in kept) / n
        mean_v = sum(v for _, v in kept) / n
        var = sum((t - mean_t) ** 2 for t, _ in kept)
        if var == 0:
            return None
        cov = sum((t - mean_t) * (v - mean_v) for t, v in kept)
        return cov / var * 3600

    @property
    def life_s(self) -> float:
        return self.points[-1][0] - self.points[0][0] if self.points else 0.0


@dataclass
class Observer:
    stack: LocalStack
    clock: Callable[[], float]
    every_s: float = 5.0
    rss: dict[tuple[str, int], Series] = field(default_factory=dict)
    """(process name, pid) -> its resident memory in MB"""
    redis_memory: list[tuple[float, int, int]] = field(default_factory=list)
    """(when, used_memory bytes, keys)"""
    jobs: dict[str, str] = field(default_factory=dict)
    """job id -> the last status seen"""
    _lock: threading.Lock = field(default_factory=threading.Lock)
    _stop: threading.Event = field(default_factory=threading.Event)
    _thread: threading.Thread | None = None

    def start(self) -> None:
        self._thread = threading.Thread(target=self._loop, name="soak-observer", daemon=True)
        self._thread.start()

    def stop(self) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout=60)

    def _loop(self) -> None:
        while True:
            self.sample()
            if self._stop.wait(self.every_s):
                return

    def sample(self) -> None:
        now = self.clock()
        for child in list(self.stack.children):
            if child.name in ("redis", "s3"):
                continue
            for role, process in _processes(child.name, child.pid):
                with contextlib.suppress(psutil.Error):
                    mb = process.memory_info().rss / 2**20
                    key = (f"{child.name}/{role}", process.pid)
                    series = self.rss.setdefault(key, Series(role, child.name, process.pid))
                    series.points.append((now, mb))
        with contextlib.suppress(RedisError, OSError):
            redis = self.stack.redis()
            info = redis.info("memory")
            self.redis_memory.append((now, int(info["used_memory"]), int(redis.dbsize())))
            self._scan_jobs(redis)

    def _scan_jobs(self, redis: Redis) -> None:
        keys = [str(k) for k in redis.scan_iter(match=JOB_PATTERN, count=1000)]
        pipe = redis.pipeline(transaction=False)
        for key in keys:
            pipe.hget(key, "status")
        statuses = pipe.execute()
        with self._lock:
            for key, status in zip(keys, statuses, strict=True):
                if status is not None:
                    self.jobs[key.rsplit(":", 1)[1]] = str(status)

    def final_statuses(self) -> dict[str, str]:
        """Every job seen, with its status now for those last seen unfinished ("expired":
        its record is gone)."""
        with self._lock:
            seen = dict(self.jobs)
        unfinished = [job_id for job_id, status in seen.items() if status not in TERMINAL]
        redis = self.stack.redis()
        pipe = redis.pipeline(transaction=False)
        for job_id in unfinished:
            pipe.hget(f"{PREFIX}:job:{job_id}", "status")
        for job_id, status in zip(unfinished, pipe.execute(), strict=True):
            seen[job_id] = str(status) if status is not None else "expired"
        return seen

    def dump(self) -> dict[str, object]:
        return {
            "rss_mb": [
                {"name": s.name, "role": s.role, "pid": s.pid, "points": s.points}
                for s in self.rss.values()
            ],
            "redis": self.redis_memory,
        }


def _processes(name: str, pid: int) -> list[tuple[str, psutil.Process]]:
    """The processes of one service worth watching: a job worker's Celery process and its
    engine core; the gateway's uvicorn; the webhook worker."""
    try:
        root = psutil.Process(pid)
        found = [("main", root)]
        if name.startswith("soak-worker"):
            for child in root.children(recursive=True):
                with contextlib.suppress(psutil.Error):
                    if "EngineCore" in " ".join(child.cmdline()):
                        found.append(("engine", child))
        return found
    except psutil.Error:
        return []
