"""The soak's faults and the supervisor that restarts what they kill.

The supervisor does what systemd or Kubernetes does for a deployment: a service process that
exits (or is killed) is started again after a second, with the same command and environment.
The fault schedule kills: a worker's whole process group (SIGKILL: worker, engine core, no
clean-up), Redis (SIGKILL, restarted on its append-only file), the S3 server's network (10 s
of refused connections), the gateway (SIGKILL), and one engine core alone (the worker must
notice, hand its jobs back and exit).

moto keeps its objects in memory, so "S3 down" cannot stop moto itself: the stack reaches it
through a TCP proxy here that stops listening and drops its connections for the outage (what
a client sees of an unreachable endpoint: connection refused).
"""

from __future__ import annotations

import contextlib
import os
import signal
import socket
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field

import psutil

from lorafleet.processes import Child
from lorafleet.stack import LocalStack

RESTART_AFTER_S = 1.0
S3_DOWN_S = 10.0
REDIS_DOWN_S = 2.0
FAULTS = ("worker_kill", "redis_kill", "s3_down", "gateway_kill", "engine_core_kill")


class TcpProxy:
    """Forwards a local port to ``upstream``; ``down`` refuses and drops connections."""

    def __init__(self, upstream: tuple[str, int]) -> None:
        self._upstream = upstream
        self._listener: socket.socket | None = None
        self._open: set[socket.socket] = set()
        self._lock = threading.Lock()
        self.port = 0

    def up(self, retry_s: float = 0.0) -> None:
        """Listen (again, on the same port once it had one); ``retry_s``: keep trying that
        long if the port is taken meanwhile (an outgoing connection's local port, say)."""
        listener = socket.socket()
        listener.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        give_up = time.monotonic() + retry_s
        while True:
            try:
                listener.bind(("127.0.0.1", self.port))
                break
            except OSError:
                if time.monotonic() > give_up:
                    listener.close()
                    raise
                time.sleep(0.5)
        listener.listen(128)
        self.port = listener.getsockname()[1]
        self._listener = listener
        threading.Thread(target=self._accept, args=(listener,), daemon=True).start()

    def down(self) -> None:
        with self._lock:
            listener, self._listener = self._listener, None
            sockets, self._open = self._open, set()
        if listener is not None:
            with contextlib.suppress(OSError):
                listener.shutdown(socket.SHUT_RDWR)
            listener.close()
        for sock in sockets:
            with contextlib.suppress(OSError):
                sock.shutdown(socket.SHUT_RDWR)
            sock.close()

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def _accept(self, listener: socket.socket) -> None:
        while True:
            try:
                client, _ = listener.accept()
            except OSError:
                return
            try:
                server = socket.create_connection(self._upstream, timeout=5)
                server.settimeout(None)
            except OSError:
                client.close()
                continue
            with self._lock:
                if self._listener is not listener:  # went down meanwhile
                    client.close()
                    server.close()
                    return
                self._open.update((client, server))
            for a, b in ((client, server), (server, client)):
                threading.Thread(target=self._pump, args=(a, b), daemon=True).start()

    def _pump(self, src: socket.socket, dst: socket.socket) -> None:
        # One side's end closes both: S3 clients never half-close a connection.
        try:
            while data := src.recv(65536):
                dst.sendall(data)
        except OSError:
            pass
        finally:
            for sock in (src, dst):
                with contextlib.suppress(OSError):
                    sock.shutdown(socket.SHUT_RDWR)
            with self._lock:
                self._open.discard(src)
                self._open.discard(dst)
            src.close()


@dataclass
class FaultRecord:
    name: str
    at_s: float
    """when it was done, seconds since the run began"""
    target: str
    restored_at_s: float | None = None
    """when the part it took was back: a replacement worker announced, Redis answering, the
    proxy listening, the gateway ready"""
    note: str = ""


@dataclass
class Supervisor:
    """Restarts the job workers, the gateway and the webhook worker when they exit; carries
    out the fault schedule. Once started, everything touching the stack's processes happens
    on its one thread, which lives until ``stop``: Linux sends a child's parent-death signal
    when the *thread* that started it exits, so processes it started would die with it.
    ``quiesce`` ends the faults and the restarts and leaves the processes running. An error
    of its own is kept in ``errors`` (the run reports it) and the loop goes on."""

    stack: LocalStack
    proxy: TcpProxy
    worker_env: dict[str, str]
    gateway_env: dict[str, str]
    clock: Callable[[], float]
    schedule: list[tuple[float, str]]
    faults: list[FaultRecord] = field(default_factory=list)
    restarts: list[tuple[float, str, int | None]] = field(default_factory=list)
    """(when, process name, its exit code) of every restart"""
    errors: list[str] = field(default_factory=list)
    _replaced: dict[str, str] = field(default_factory=dict)
    _slots: dict[str, int] = field(default_factory=dict)
    """worker name -> the name of the worker started in its place"""
    _spawned: int = 0
    _stop: threading.Event = field(default_factory=threading.Event)
    _quiet: threading.Event = field(default_factory=threading.Event)
    _idle: bool = False
    _thread: threading.Thread | None = None
    _waiting: list[tuple[FaultRecord, Callable[[], bool]]] = field(default_factory=list)
    _dead_since: dict[str, float] = field(default_factory=dict)

    def spawn_worker(self, slot: int | None = None) -> Child:
        """A job worker with a disk cache of its own (one worker process per directory, as
        the cache requires); a replacement takes the slot, and the disk, of the one gone,
        as a restarted container keeps its pod's volume."""
        self._spawned += 1
        slot = self._spawned if slot is None else slot
        name = f"soak-worker-{self._spawned}"
        env = {
            **self.worker_env,
            "LORAFLEET_WORKER_NAME": f"{name}@%h",
            "LORAFLEET_CACHE_DIR": str(self.stack.state_dir / f"cache-{slot}"),
        }
        self._slots[name] = slot
        return self.stack.spawn_worker(env, name=name)

    def job_workers(self) -> list[Child]:
        return [c for c in self.stack.children if c.name.startswith("soak-worker")]

    def start(self) -> None:
        self._thread = threading.Thread(target=self._loop, name="soak-supervisor", daemon=True)
        self._thread.start()

    def wait_restored(self, timeout_s: float) -> None:
        """Until every fault's part is back (a replacement worker announced, say)."""
        deadline = time.monotonic() + timeout_s
        while self._waiting and time.monotonic() < deadline:
            time.sleep(0.25)

    def quiesce(self) -> None:
        """No more faults or restarts; returns once the loop has taken note."""
        self._quiet.set()
        while self._thread is not None and self._thread.is_alive() and not self._idle:
            time.sleep(0.05)

    def stop(self) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout=120)

    def _loop(self) -> None:
        pending = sorted(self.schedule)
        while not self._stop.wait(0.25):
            if self._quiet.is_set():
                self._idle = True
                continue
            while pending and pending[0][0] <= self.clock():
                _, name = pending.pop(0)
                try:
                    self._inject(name)
                except Exception as exc:  # a fault that could not be done is reported
                    self.faults.append(FaultRecord(name, self.clock(), "-", note=repr(exc)))
            try:
                self._restart_dead()
            except Exception as exc:
                self.errors.append(f"{self.clock():.1f} s: restarting: {exc!r}")
            for record, check in list(self._waiting):
                with contextlib.suppress(Exception):  # Redis down: asked again next turn
                    if check():
                        record.restored_at_s = self.clock()
                        self._waiting.remove((record, check))

    def _restart_dead(self) -> None:
        for child in list(self.stack.children):
            if child.name in ("redis", "s3") or child.alive():
                continue
            first_seen = self._dead_since.setdefault(child.name, time.monotonic())
            if time.monotonic() - first_seen < RESTART_AFTER_S:
                continue
            del self._dead_since[child.name]
            self.stack.children.remove(child)
            self.restarts.append((self.clock(), child.name, child.process.returncode))
            if child.name.startswith("soak-worker"):
                slot = self._slots[child.name]
                self._replaced[child.name] = self.spawn_worker(slot).name
            elif child.name == "gateway":
                port = int(self.stack.gateway_url.rsplit(":", 1)[1])
                self.stack.spawn_gateway(self.gateway_env, port=port)
            elif child.name == "webhooks":
                self.stack.spawn_webhooks(self.gateway_env)

    def _replacement_announced(self, victim: str) -> Callable[[], bool]:
        """True once the worker started in ``victim``'s place announced itself."""

        def check() -> bool:
            name = self._replaced.get(victim)
            live = [c for c in self.job_workers() if c.name == name and c.alive()]
            return any(self.stack.worker_id(c) for c in live)

        return check

    def _inject(self, name: str) -> None:
        now = self.clock()
        serving = [c for c in self.job_workers() if c.alive() and self.stack.worker_id(c)]
        if name == "worker_kill":
            victim = serving[0] if serving else self.job_workers()[0]
            os.killpg(victim.pid, signal.SIGKILL)
            record = FaultRecord(name, now, victim.name)
            self._waiting.append((record, self._replacement_announced(victim.name)))
        elif name == "engine_core_kill":
            victim = serving[-1] if serving else self.job_workers()[-1]
            engine_core(victim).kill()
            record = FaultRecord(name, now, victim.name)
            self._waiting.append((record, self._replacement_announced(victim.name)))
        elif name == "redis_kill":
            record = FaultRecord(name, now, "redis")
            self.stack.restart_redis(down_s=REDIS_DOWN_S, kill=True)
            record.restored_at_s = self.clock()
        elif name == "s3_down":
            record = FaultRecord(name, now, "s3")
            self.proxy.down()
            time.sleep(S3_DOWN_S)  # the supervisor sleeps with it: nothing else is due
            self.proxy.up(retry_s=30)
            record.restored_at_s = self.clock()
        elif name == "gateway_kill":
            gateway = next(c for c in self.stack.children if c.name == "gateway")
            os.killpg(gateway.pid, signal.SIGKILL)
            record = FaultRecord(name, now, "gateway")
            self._waiting.append((record, self.stack.gateway_ready))
        else:
            raise ValueError(f"no fault named {name!r}; known: {', '.join(FAULTS)}")
        self.faults.append(record)


def engine_core(worker: Child) -> psutil.Process:
    """The vLLM engine-core process of ``worker`` (titled ``VLLM::EngineCore``)."""
    for child in psutil.Process(worker.pid).children(recursive=True):
        with contextlib.suppress(psutil.Error):
            if "EngineCore" in " ".join(child.cmdline()):
                return child
    raise RuntimeError(f"{worker.name} has no engine-core process")


def schedule_for(
    duration_s: float, worker_kill_every_s: float | None = None
) -> list[tuple[float, str]]:
    """Each fault once, spread over the run (none in its first or last tenth), and a worker
    killed every ``worker_kill_every_s`` besides, away from the other faults."""
    fractions = {
        "worker_kill": 0.12,
        "redis_kill": 0.28,
        "s3_down": 0.42,
        "gateway_kill": 0.56,
        "engine_core_kill": 0.70,
    }
    plan = [(duration_s * f, name) for name, f in fractions.items()]
    plan.append((duration_s * 0.86, "worker_kill"))
    if worker_kill_every_s:
        at = worker_kill_every_s
        while at < duration_s * 0.9:
            if all(abs(at - t) > 60 for t, _ in plan):
                plan.append((at, "worker_kill"))
            at += worker_kill_every_s
    return sorted(plan)
