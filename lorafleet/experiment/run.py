"""``lorafleet experiment run``: every cell of the manifest, on the local stack or a deployment.

Local: the stack's Redis, S3 and gateway start once; each sweep cell is a worker started
through the Procfile command with that cell's engine limits. A configuration the worker or its
engine refuses is recorded as a rejection with the error it printed. A reset trial stops the
worker, deletes its disk cache and starts it again; a warmed trial first sends every adapter
one request. Remote (``--gateway``): nothing can be restarted; the configuration the manifest
states is recorded as assumed, and only warmed trials run.
"""

from __future__ import annotations

import asyncio
import json
import re
import shutil
import subprocess
import sys
import time
from collections.abc import Callable
from datetime import UTC, datetime
from pathlib import Path
from typing import TYPE_CHECKING

import httpx
import psutil
from rich.console import Console
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TimeElapsedColumn

from lorafleet.experiment.analysis import decide, trial_result
from lorafleet.experiment.drive import (
    PREFETCH_PROBE,
    SAMPLE_EVERY_S,
    Probe,
    TrialContext,
    drive,
)
from lorafleet.experiment.manifest import LOCAL_RESET, Manifest, ManifestError
from lorafleet.experiment.results import (
    CellConfig,
    CellResult,
    RequestRecord,
    Results,
    Startup,
    Trial,
    TrialResult,
)
from lorafleet.experiment.traffic import plan, prompt_text, word_count
from lorafleet.processes import Child
from lorafleet.settings import LocalSettings

if TYPE_CHECKING:
    from lorafleet.stack import LocalStack

EXPERIMENT_TENANT = "experiment"
ERROR_LINE = re.compile(r"\b\w*(error|exception)[:,]", re.IGNORECASE)
LOCAL_NOT_RESET = [
    "the OS page cache (adapter and model files read before stay cached by the kernel)",
    "the S3 server's own caches",
    "the gateway process (it keeps running across cells)",
]
REMOTE_NOT_RESET = [
    "workers (not restarted: a remote deployment)",
    "worker disk caches",
    "engine CPU caches",
    "the OS page cache",
    "remote artifact caches",
]


def engine_help(out_dir: Path) -> None:
    """The installed engine's own ``serve --help=all``, kept beside the results."""
    argv = [sys.executable, "-m", "lorafleet.vllm_cli", "serve", "--help=all"]
    try:
        done = subprocess.run(argv, capture_output=True, text=True, timeout=300, check=False)
        text = done.stdout or done.stderr
    except (OSError, subprocess.TimeoutExpired) as exc:
        text = f"could not run {' '.join(argv)}: {exc}"
    (out_dir / "engine-help.txt").write_text(text)


class _Out:
    """``requests.jsonl``, appended trial by trial, so a run cut short keeps what it sent."""

    def __init__(self, out_dir: Path) -> None:
        self.path = out_dir / "requests.jsonl"
        self.path.write_text("")
        self.records: list[RequestRecord] = []

    def add(self, records: list[RequestRecord]) -> None:
        with self.path.open("a") as handle:
            for record in records:
                handle.write(record.model_dump_json() + "\n")
        self.records.extend(records)


def _tokens_counter(base_dir: Path | None) -> Callable[[str], int]:
    tokenizer_file = base_dir / "tokenizer.json" if base_dir is not None else None
    if tokenizer_file is None or not tokenizer_file.exists():
        return word_count
    from tokenizers import Tokenizer

    tokenizer = Tokenizer.from_file(str(tokenizer_file))
    return lambda text: len(tokenizer.encode(text, add_special_tokens=False).ids)


def _prompts(manifest: Manifest, count: Callable[[str], int]) -> dict[tuple[int, int], str]:
    return {
        (prompt_id, bucket): prompt_text(manifest, prompt_id, bucket, count)
        for prompt_id in range(len(manifest.prompt_corpus.prompts))
        for bucket in manifest.input_token_buckets
    }


def _fleet_probe(http: httpx.AsyncClient) -> Probe:
    async def admitted_unfinished() -> float | None:
        response = await http.get("/v1/fleet")
        if response.status_code != 200:
            return None  # the key is not an operator's: queue depth is not readable
        return float(sum(tier["admitted_unfinished"] for tier in response.json()["tiers"]))

    return admitted_unfinished


def _rss_mb(pid: int) -> float | None:
    """Resident memory of a process and its descendants (the worker and its engine core)."""
    try:
        root = psutil.Process(pid)
        processes = [root, *root.children(recursive=True)]
    except psutil.NoSuchProcess:
        return None
    total = 0
    for process in processes:
        try:
            total += process.memory_info().rss
        except psutil.NoSuchProcess:
            continue
    return round(total / 1024**2, 1)


class Experiment:
    """Runs the manifest's trials against a gateway; ``run_local`` adds the workers' lifecycle."""

    def __init__(
        self, manifest: Manifest, out_dir: Path, console: Console, progress: Progress
    ) -> None:
        self.manifest = manifest
        self.out_dir = out_dir
        self.console = console
        self.progress = progress
        self.out = _Out(out_dir)
        self.expected = {entry.alias: entry.digest for entry in manifest.adapter_registry}
        base = Path(manifest.base_model.path) if manifest.base_model.path else None
        self.prompts = _prompts(manifest, _tokens_counter(base))
        self.gateway_url = ""
        self.api_key = ""
        self.task = progress.add_task("requests", total=self._planned())

    def _planned(self, baseline: bool = False) -> int:
        m = self.manifest
        per_cell = len(m.trials) * len(m.offered_rates) * len(m.traffic_profiles) * m.repetitions
        cold_swap = len(m.offered_rates) * len(m.cold_swap_baseline) * m.repetitions
        return (per_cell * len(m.cells()) + (cold_swap if baseline else 0)) * m.requests_per_cell

    def probes(self, http: httpx.AsyncClient) -> dict[str, Probe]:
        return {"queue_depth": _fleet_probe(http)}

    async def warm(self) -> str | None:
        """One request per approved adapter, waited for, so each has been fetched, verified
        and in the engine once before a warmed trial; what went wrong, or ``None``."""
        headers = {"Authorization": f"Bearer {self.api_key}"}
        prompt = self.manifest.prompt_corpus.prompts[0]
        try:
            async with httpx.AsyncClient(
                base_url=self.gateway_url, headers=headers, timeout=self.manifest.request_timeout_s
            ) as http:
                for alias in self.expected:
                    body = {"model": alias, "prompt": prompt, "max_tokens": 1}
                    response = await http.post("/v1/completions", json=body)
                    if response.status_code != 200:
                        return f"warming {alias}: {response.status_code} {response.text[:300]}"
        except httpx.HTTPError as exc:
            return f"warming the adapters: {type(exc).__name__}: {exc}"
        return None

    def run_cell(
        self,
        cell: CellResult,
        reset: Callable[[CellResult], Startup] | None,
        probes: dict[str, Probe],
        died: Callable[[], str | None] = lambda: None,
    ) -> None:
        """Every trial of ``cell``; the first one that cannot run (a restart or warm-up that
        fails, a worker that exited) ends the cell, saying why in ``cell.stopped``."""
        m = self.manifest
        for trial in m.trials:
            for rate in m.offered_rates:
                for profile in m.traffic_profiles:
                    for repetition in range(m.repetitions):
                        startup = None
                        if trial == "reset" and reset is not None:
                            startup = reset(cell)
                            if startup.outcome != "started":
                                cell.stopped = f"restart for a reset trial: {startup.outcome}: "
                                cell.stopped += startup.error or ""
                                return
                        elif trial == "warmed" and (problem := asyncio.run(self.warm())):
                            cell.stopped = problem
                            return
                        result = self.run_trial(cell.id, trial, rate, profile, repetition, probes)
                        if startup is not None:
                            result.worker_start_s = startup.seconds
                        cell.trials.append(result)
                        if (gone := died()) is not None:
                            cell.stopped = f"the worker exited during the trial: {gone}"
                            return

    def run_trial(
        self,
        cell: str,
        trial: Trial,
        rate: float,
        profile: str,
        repetition: int,
        probes: dict[str, Probe],
    ) -> TrialResult:
        m = self.manifest
        context = TrialContext(cell, trial, profile, repetition, rate)  # type: ignore[arg-type]
        sequence = plan(m, context.profile, rate, repetition)
        self.progress.update(
            self.task, description=f"{cell} {trial} {profile} @{rate:g}/s #{repetition}"
        )

        async def go() -> TrialResult:
            headers = {"Authorization": f"Bearer {self.api_key}"}
            async with httpx.AsyncClient(
                base_url=self.gateway_url, headers=headers, timeout=5
            ) as http:
                driven = await drive(
                    self.gateway_url,
                    self.api_key,
                    context,
                    sequence.requests,
                    self.prompts,
                    self.expected,
                    m.generator_concurrency_limit,
                    m.request_timeout_s,
                    probes={**self.probes(http), **probes},
                    on_handled=lambda: self.progress.advance(self.task),
                )
            self.out.add(driven.records)
            return trial_result(m, context, rate, sequence, driven)

        return asyncio.run(go())


def run_remote(
    manifest: Manifest, out_dir: Path, gateway_url: str, api_key: str, console: Console
) -> Results:
    """Against a deployment: its configuration is what the manifest states (first value of
    each sweep), recorded as assumed; only warmed trials, as nothing can be reset."""
    started_at = datetime.now(tz=UTC).isoformat()
    trials: list[Trial] = ["warmed"]
    runnable = manifest.model_copy(update={"trials": trials})
    if not manifest.cells():
        raise ManifestError("manifest_invalid", "The sweeps leave no cell to run.")
    sweeps = manifest.sweeps
    config = CellConfig(
        max_loras=sweeps.max_loras[0],
        max_cpu_loras=sweeps.max_cpu_loras[0],
        max_lora_rank=sweeps.max_lora_rank[0],
    )
    cell = CellResult(
        id="deployment", sweep="as deployed", config=config, startup=Startup(outcome="assumed")
    )
    with _progress(console) as progress:
        experiment = Experiment(runnable, out_dir, console, progress)
        progress.update(experiment.task, total=experiment._planned() // len(manifest.cells()))
        experiment.gateway_url, experiment.api_key = gateway_url.rstrip("/"), api_key
        experiment.run_cell(cell, None, {})
    if "reset" in manifest.trials:
        console.print("[yellow]reset trials skipped: a remote deployment cannot be reset[/]")
    # Decided on what could run: a deployment has no reset trials, so no candidate verdict.
    return _results(
        manifest, "remote", started_at, [cell], experiment.out.records, REMOTE_NOT_RESET, runnable
    )


def _progress(console: Console) -> Progress:
    return Progress(
        "[progress.description]{task.description}",
        BarColumn(),
        MofNCompleteColumn(),
        TimeElapsedColumn(),
        console=console,
    )


def _results(
    manifest: Manifest,
    mode: str,
    started_at: str,
    cells: list[CellResult],
    records: list[RequestRecord],
    not_reset: list[str],
    decided_on: Manifest | None = None,
) -> Results:
    hot = [entry.alias for entry in manifest.adapter_registry if entry.tier == "hot"]
    if hot and mode == "local":
        not_reset = [*not_reset, f"hot-tier adapters, pinned when the worker starts: {hot}"]
    return Results(
        reset_procedure=LOCAL_RESET if mode == "local" else "none: a deployment is not reset",
        experiment_id=manifest.experiment_id,
        mode=mode,  # type: ignore[arg-type]
        started_at=started_at,
        finished_at=datetime.now(tz=UTC).isoformat(),
        manifest=manifest.model_dump(mode="json"),
        not_reset=not_reset,
        cells=cells,
        decision=decide(decided_on or manifest, cells, records),
    )


def preflight_local(manifest: Manifest, settings: LocalSettings) -> Path:
    """Everything a local run can check before it writes or starts anything: no local stack
    already running in this state directory, and base model and adapter files that hash to
    the digests the manifest records. The base model's directory."""
    from contracts.digests import manifest_of
    from lorafleet.experiment.manifest import tokenizer_digest
    from lorafleet.validation import ADAPTER_FILES, CONFIG_FILE

    if settings.stack_file.exists():
        raise ManifestError(
            "stack_running",
            f"A local stack is running ({settings.stack_file}); stop it with `lorafleet stack "
            "down` or set LORAFLEET_STATE_DIR to another directory for the experiment.",
        )
    problems = []
    model = Path(manifest.base_model.path or "")
    if manifest.base_model.path is None or not model.is_dir():
        problems.append(f"base_model.path {manifest.base_model.path!r} is not a directory")
    else:
        found = manifest_of(model).digest()
        if found != manifest.base_model.digest:
            problems.append(f"base model files at {model} hash to {found}")
        tokenizer = tokenizer_digest(model)
        if tokenizer != manifest.tokenizer_and_template_digest:
            problems.append(f"tokenizer and template files hash to {tokenizer}")
    for entry in manifest.adapter_registry:
        path = Path(entry.path or "")
        if entry.path is None or not path.is_dir():
            problems.append(f"{entry.alias}: path {entry.path!r} is not a directory")
            continue
        found = manifest_of(path, ADAPTER_FILES).digest()
        if found != entry.digest:
            problems.append(f"{entry.alias}: files at {path} hash to {found}")
        config = (
            json.loads((path / CONFIG_FILE).read_text()) if (path / CONFIG_FILE).exists() else {}
        )
        declared = (config.get("r"), sorted(config.get("target_modules") or []))
        if declared != (entry.rank, sorted(entry.target_modules)):
            problems.append(
                f"{entry.alias}: its config says rank {declared[0]}, targets {declared[1]}; "
                f"the manifest records rank {entry.rank}, targets {sorted(entry.target_modules)}"
            )
        if entry.base != manifest.base_model.digest:
            problems.append(f"{entry.alias}: base {entry.base} is not the base model's digest")
    if problems:
        raise ManifestError(
            "manifest_mismatch",
            "What the manifest records is not what a local run would test: "
            + "; ".join(problems)
            + ". (`lorafleet experiment digest DIR` prints a directory's digest.)",
            problems,
        )
    return model


def preflight_remote(gateway_url: str, api_key: str, manifest: Manifest) -> None:
    """The gateway answers, the key is accepted, and it resolves every alias of the registry
    to the digest the manifest records (``GET /v1/models``: ``root`` is the revision)."""
    headers = {"Authorization": f"Bearer {api_key}"}
    url = gateway_url.rstrip("/") + "/v1/models"
    try:
        response = httpx.get(url, headers=headers, timeout=15)
    except (httpx.HTTPError, httpx.InvalidURL, UnicodeError) as exc:
        raise ManifestError(
            "gateway_unreachable", f"{url!r} did not answer: {type(exc).__name__}: {exc}"
        ) from exc
    if response.status_code != 200:
        raise ManifestError(
            "gateway_refused", f"{url} answered {response.status_code}: {response.text[:300]}"
        )
    try:
        listed = {str(model["id"]): model.get("root") for model in response.json()["data"]}
    except (ValueError, KeyError, TypeError) as exc:
        raise ManifestError(
            "gateway_refused", f"{url} did not answer with a model list: {response.text[:200]}"
        ) from exc
    missing = [e.alias for e in manifest.adapter_registry if e.alias not in listed]
    if missing:
        raise ManifestError(
            "adapter_not_found", f"The gateway does not serve {missing} to this key."
        )
    other = [e.alias for e in manifest.adapter_registry if listed[e.alias] != e.digest]
    if other:
        raise ManifestError(
            "manifest_mismatch",
            f"The gateway resolves {other} to other digests than the manifest records.",
        )


def run_local(
    manifest: Manifest, out_dir: Path, settings: LocalSettings, console: Console
) -> Results:
    """Every cell on this machine's stack (private Redis and S3 unless configured)."""
    from contracts.queues import Tier
    from contracts.tenants import ALL_ADAPTERS, TenantLimits
    from lorafleet.registry import RegistryError
    from lorafleet.stack import LocalStack
    from lorafleet.tenants import Tenants
    from lorafleet.validation import ValidationFailure

    model = preflight_local(manifest, settings)
    started_at = datetime.now(tz=UTC).isoformat()
    cells: list[CellResult] = []
    with LocalStack(settings, model) as stack, _progress(console) as progress:
        console.print("local stack: Redis, S3, gateway; publishing the registry")
        stack.start_infra()
        publisher = stack.publisher()
        for entry in manifest.adapter_registry:
            assert entry.path is not None
            try:
                record = publisher.publish(Path(entry.path), entry.alias, Tier(entry.tier))
            except (ValidationFailure, RegistryError) as exc:
                raise ManifestError(
                    "publish_refused", f"{entry.alias}: {exc.code}: {exc.message}"
                ) from exc
            if record.digest != entry.digest:
                raise ManifestError(
                    "manifest_mismatch",
                    f"{entry.alias}: the registry holds {record.digest}, the manifest records "
                    f"{entry.digest}; the experiment would not test the approved revision.",
                )
        tenants = Tenants(stack.redis())
        limits = TenantLimits(max_concurrent=100_000, rate_per_s=100_000.0, burst=100_000)
        try:
            _, key = tenants.create(EXPERIMENT_TENANT, limits, operator=True)
        except RegistryError:
            _, key = tenants.create_key(EXPERIMENT_TENANT)
        tenants.grant(EXPERIMENT_TENANT, ALL_ADAPTERS)
        stack.start_gateway()
        experiment = Experiment(manifest, out_dir, console, progress)
        progress.update(experiment.task, total=experiment._planned(baseline=True))
        experiment.gateway_url, experiment.api_key = stack.gateway_url, key

        for sweep, loras, cpu, rank in manifest.cells():
            config = CellConfig(max_loras=loras, max_cpu_loras=cpu, max_lora_rank=rank)
            cache = Path(stack.service_env()["LORAFLEET_CACHE_DIR"])
            worker = _CellWorker(stack, config, cache)
            console.print(f"cell {worker.cell_id} ({sweep}): starting a worker")
            cell = CellResult(id=worker.cell_id, sweep=sweep, config=config, startup=worker.start())
            cells.append(cell)
            if cell.startup.outcome != "started":
                console.print(f"[yellow]cell {cell.id}: worker {cell.startup.outcome}[/]")
                progress.advance(experiment.task, experiment._planned() // len(manifest.cells()))
                continue
            try:
                experiment.run_cell(cell, worker.reset, worker.probes(), worker.died)
            finally:
                worker.stop()
        baseline = _cold_swap(experiment, stack, model) if manifest.cold_swap_baseline else None
    results = _results(
        manifest, "local", started_at, cells, experiment.out.records, LOCAL_NOT_RESET
    )
    return results.model_copy(update={"baseline": baseline})


def _cold_swap(experiment: Experiment, stack: LocalStack, model: Path) -> CellResult:
    """The same sequences against the cold-swap baseline server (after every lorafleet
    worker stopped, so it has the machine to itself)."""
    from lorafleet.processes import free_port, spawn, wait_until

    m = experiment.manifest
    port = free_port()
    argv = [sys.executable, "-m", "lorafleet.experiment.cold_swap", "--port", str(port)]
    argv += ["--base", str(model)]
    for entry in m.adapter_registry:
        argv += ["--adapter", f"{entry.alias}={entry.path}={entry.digest}"]
    experiment.console.print("cold-swap baseline: one PEFT model object, adapters swapped in place")
    began = time.monotonic()
    server = spawn("cold-swap", argv, stack.service_env(), stack.log_dir, stack.log_dir)
    rank = max(entry.rank for entry in m.adapter_registry)
    cell = CellResult(
        id="cold-swap",
        sweep="baseline",
        config=CellConfig(max_loras=1, max_cpu_loras=1, max_lora_rank=rank),
        startup=Startup(outcome="started"),
    )
    url = f"http://127.0.0.1:{port}"
    try:
        wait_until(
            lambda: httpx.get(f"{url}/health").status_code == 200, 300, "cold-swap", [server]
        )
        cell.startup = Startup(outcome="started", seconds=_since(began))
        lorafleet_url, experiment.gateway_url = experiment.gateway_url, url
        probes: dict[str, Probe] = {"worker_rss_mb": lambda: _async(_rss_mb(server.pid))}
        try:
            for rate in m.offered_rates:
                for profile in m.cold_swap_baseline:
                    for repetition in range(m.repetitions):
                        cell.trials.append(
                            experiment.run_trial(
                                cell.id, "warmed", rate, profile, repetition, probes
                            )
                        )
        finally:
            experiment.gateway_url = lorafleet_url
    except (RuntimeError, TimeoutError) as exc:
        cell.startup = Startup(outcome="rejected", seconds=_since(began), error=_refusal(str(exc)))
    finally:
        server.stop()
    return cell


async def _async(value: float | None) -> float | None:
    return value


class _CellWorker:
    """The worker of one sweep cell, started through the Procfile command with its limits."""

    def __init__(self, stack: LocalStack, config: CellConfig, cache: Path) -> None:
        self.stack = stack
        self.cache = cache
        self.cell_id = f"L{config.max_loras}-C{config.max_cpu_loras}-R{config.max_lora_rank}"
        self.env = {
            "LORAFLEET_MAX_LORAS": str(config.max_loras),
            "LORAFLEET_MAX_CPU_LORAS": str(config.max_cpu_loras),
            "LORAFLEET_MAX_LORA_RANK": str(config.max_lora_rank),
        }
        self.child: Child | None = None
        self.trials_at_start = 0
        self._counts: list[_PrefetchCounts] = []  # the probes' readers, closed at stop

    def start(self, trials_so_far: int = 0) -> Startup:
        """The reset procedure: stop the worker (its engine and CPU cache go with it), delete
        the disk cache, start it again and wait until it announces itself."""
        self.stop()
        shutil.rmtree(self.cache, ignore_errors=True)
        if self.cache.exists():
            raise RuntimeError(f"the reset could not empty the disk cache {self.cache}")
        began = time.monotonic()
        self.child = self.stack.spawn_worker(self.env, name="worker")
        self.trials_at_start = trials_so_far
        try:
            self.stack.wait_worker(self.child)
        except RuntimeError as exc:  # it exited: the worker or its engine refused
            self.stop()
            return Startup(outcome="rejected", seconds=_since(began), error=_refusal(str(exc)))
        except TimeoutError as exc:
            self.stop()
            return Startup(outcome="timeout", seconds=_since(began), error=str(exc))
        return Startup(outcome="started", seconds=_since(began))

    def died(self) -> str | None:
        """The log tail of a worker that exited, else ``None``."""
        if self.child is None or self.child.alive():
            return None
        return f"exit status {self.child.process.returncode}:\n{self.child.log_tail()}"

    def reset(self, cell: CellResult) -> Startup:
        """Reset before a trial, unless no trial ran since the worker started empty."""
        if self.child is not None and len(cell.trials) == self.trials_at_start:
            return cell.startup
        return self.start(len(cell.trials))

    def stop(self) -> None:
        for counts in self._counts:
            counts.close()
        if self.child is not None:
            self.stack.stop_child(self.child)
            if self.child.alive():  # never two workers on one cache
                raise RuntimeError(f"the worker (pid {self.child.pid}) did not stop")
            self.child = None

    def probes(self) -> dict[str, Probe]:
        async def rss_mb() -> float | None:
            return None if self.child is None else _rss_mb(self.child.pid)

        probes: dict[str, Probe] = {"worker_rss_mb": rss_mb}
        if shutil.which("nvidia-smi"):  # never run on the machines this was built on
            probes["gpu_memory_mb"] = _gpu_memory_mb
        from contracts.metrics import PREFETCH_OUTCOMES

        counts = _PrefetchCounts(self.stack, lambda: self.child)
        self._counts.append(counts)
        for outcome in PREFETCH_OUTCOMES:
            probes[PREFETCH_PROBE + outcome] = counts.probe(outcome)
        return probes


_OUTCOME = re.compile(r'(?:^|,)outcome="([^"]*)"')


class _PrefetchCounts:
    """The cell worker's ``lorafleet_adapter_prefetches_total`` by outcome (every trigger
    summed), read from its metrics endpoint (found in its announcement) at most once per
    sampling round. The reading happens in a thread, with one HTTP client kept, and picks
    out its lines instead of parsing the exposition: the event loop that sends the trial's
    requests must not stall (a send 50 ms late counts as a delayed one)."""

    def __init__(self, stack: LocalStack, child: Callable[[], Child | None]) -> None:
        self._stack = stack
        self._child = child
        self._port: tuple[int, int] | None = None  # (worker pid, metrics port)
        self._read_at = 0.0
        self._counts: dict[str, float] = {}
        self._http: httpx.Client | None = None
        from contracts.metrics import ADAPTER_PREFETCHES

        self._samples = re.compile(rf"^{re.escape(ADAPTER_PREFETCHES)}\{{([^}}]*)\}} (\S+)$", re.M)

    def close(self) -> None:
        if self._http is not None:
            self._http.close()
            self._http = None

    def _metrics_port(self, pid: int) -> int | None:
        from contracts.keys import WORKERS_INDEX, worker_key

        if self._port is not None and self._port[0] == pid:
            return self._port[1]
        family = {pid, *(p.pid for p in psutil.Process(pid).children(recursive=True))}
        redis = self._stack.redis()
        for worker_id in redis.smembers(WORKERS_INDEX):
            raw = redis.get(worker_key(str(worker_id)))
            record = json.loads(raw) if raw else {}
            if record.get("pid") in family and record.get("metrics_port"):
                self._port = (pid, int(record["metrics_port"]))
                return self._port[1]
        return None

    def _scrape(self, pid: int) -> dict[str, float] | None:
        from contracts.metrics import PREFETCH_OUTCOMES

        port = self._metrics_port(pid)
        if port is None:
            return None
        if self._http is None:
            self._http = httpx.Client(timeout=2.0)
        text = self._http.get(f"http://127.0.0.1:{port}/metrics").text
        counts = dict.fromkeys(PREFETCH_OUTCOMES, 0.0)
        for labels, value in self._samples.findall(text):
            if outcome := _OUTCOME.search(labels):
                counts[outcome[1]] = counts.get(outcome[1], 0.0) + float(value)
        return counts

    async def _read(self) -> dict[str, float] | None:
        child = self._child()
        if child is None:
            return None
        if time.monotonic() - self._read_at < SAMPLE_EVERY_S / 2:
            return self._counts
        counts = await asyncio.to_thread(self._scrape, child.pid)
        if counts is None:
            return None
        self._counts, self._read_at = counts, time.monotonic()
        return counts

    def probe(self, outcome: str) -> Probe:
        async def read() -> float | None:
            counts = await self._read()
            return None if counts is None else counts.get(outcome, 0.0)

        return read


def _refusal(text: str) -> str:
    """The error a refused worker printed: its last error line first, then the log's tail."""
    lines = [line.strip() for line in text.splitlines()]
    errors = [line for line in lines if ERROR_LINE.search(line)]
    return (errors[-1].split(" [type=")[0] + "\n\n" + text) if errors else text


async def _gpu_memory_mb() -> float | None:
    """Memory in use on every GPU of this host, summed (``nvidia-smi``)."""
    process = await asyncio.create_subprocess_exec(
        "nvidia-smi",
        "--query-gpu=memory.used",
        "--format=csv,noheader,nounits",
        stdout=asyncio.subprocess.PIPE,
        stderr=asyncio.subprocess.DEVNULL,
    )
    out, _ = await process.communicate()
    try:
        return float(sum(float(line) for line in out.decode().split()))
    except ValueError:
        return None


def _since(began: float) -> float:
    return round(time.monotonic() - began, 1)


def write_results(out_dir: Path, results: Results) -> Path:
    path = out_dir / "results.json"
    tmp = path.with_suffix(".tmp")
    tmp.write_text(json.dumps(results.model_dump(mode="json"), indent=1) + "\n")
    tmp.replace(path)
    return path
