"""Result metadata is observed: residency before the job and the load phases it ran."""

from __future__ import annotations

import asyncio
from pathlib import Path

import httpx

from contracts.jobs import JobPublic, JobStatus
from contracts.queues import Tier
from contracts.registry import AdapterRecord, BaseModelRef
from lorafleet.client import JobsClient
from lorafleet.fixtures import AdapterSpec
from lorafleet.publish import Publisher
from tests.helpers import async_client, new_adapter, run_jobs

SAMPLING = {"max_tokens": 4, "temperature": 0.0}


def _run(api: httpx.Client, alias: str) -> JobPublic:
    async def go() -> JobPublic:
        async with async_client(api) as http:
            return await JobsClient(http).run(alias, "Summarise the conversation", SAMPLING)

    job = asyncio.run(go())
    assert job.status == JobStatus.SUCCEEDED, job.error
    return job


def test_residency_moves_remote_then_engine_then_disk(
    api: httpx.Client,
    tmp_path: Path,
    fixtures_dir: Path,
    base_model: BaseModelRef,
    publisher: Publisher,
    published: dict[str, AdapterRecord],
) -> None:
    def publish(name: str, seed: int) -> AdapterRecord:
        new_adapter(tmp_path, name, seed, fixtures_dir)
        return publisher.publish(tmp_path / name, name, Tier.COLD)

    # The disk cache evicts what costs least to bring back (requests x fetch time per byte),
    # and earlier tests in the run may have left it full of adapters asked for hundreds of
    # times (CI once saw the probe evicted by such a disk). Five new adapters, asked for at
    # once (held together, so they take the places of whatever was there), are what the
    # probe's download evicts later, and what pushes it out of the engine without a download.
    fillers = [publish(f"residency-filler-{i}", 780 + i).alias for i in range(5)]
    assert all(
        job.status == JobStatus.SUCCEEDED
        for job in run_jobs(
            api, [(name, "Summarise the conversation") for name in fillers], SAMPLING
        )
    )
    probe = publish("residency-probe", 777)

    first = _run(api, probe.alias)
    assert first.metadata is not None
    assert first.metadata.residency_before == "remote"
    assert first.metadata.load_ms.fetch is not None
    assert first.metadata.load_ms.verify is not None
    assert first.metadata.load_ms.engine_load is not None
    assert first.metadata.loaded_digest == probe.digest
    assert first.metadata.base_model == base_model

    second = _run(api, probe.alias)
    assert second.metadata is not None
    assert second.metadata.residency_before == "cpu"
    assert second.metadata.load_ms.model_dump() == {
        "fetch": None,
        "verify": None,
        "engine_load": None,
    }
    assert second.metadata.loaded_digest == probe.digest

    # More distinct adapters than the engine's CPU cache holds (max_cpu_loras=4, two places
    # taken by pinned hot adapters) push the probe out of the engine; its files stay on disk:
    # asked for more often than the fillers, it is not what a filler's download would evict.
    assert all(
        job.status == JobStatus.SUCCEEDED
        for job in run_jobs(api, [(probe.alias, "Summarise the conversation")] * 16, SAMPLING)
    )
    for name in fillers[1:]:
        _run(api, name)
    third = _run(api, probe.alias)
    assert third.metadata is not None
    assert third.metadata.residency_before == "disk"
    assert third.metadata.load_ms.fetch is None
    assert third.metadata.load_ms.verify is not None
    assert third.metadata.load_ms.engine_load is not None
    assert third.metadata.identity_verified is True


def test_metadata_timings_are_consistent(
    api: httpx.Client, specs: list[AdapterSpec], published: dict[str, AdapterRecord]
) -> None:
    job = _run(api, specs[0].name)
    meta = job.metadata
    assert meta is not None and job.result is not None
    assert meta.queue_wait_ms >= 0
    assert meta.ttft_ms is not None and meta.ttft_ms >= 0
    assert meta.e2e_ms >= meta.queue_wait_ms
    # Every job asks for a slot before it enters the engine; both are measured on the worker,
    # after its start, before its end (0.002 ms: each figure is rounded to a microsecond).
    assert meta.slot_wait_ms is not None and meta.to_engine_ms is not None
    assert 0 <= meta.slot_wait_ms <= meta.to_engine_ms
    assert meta.queue_wait_ms + meta.to_engine_ms <= meta.e2e_ms + 0.002
    assert meta.engine.name == "vllm" and meta.engine.version
    assert meta.worker
    assert job.result.usage.completion_tokens == len(job.result.token_ids) == 4
    assert job.result.usage.total_tokens == (
        job.result.usage.prompt_tokens + job.result.usage.completion_tokens
    )
    assert job.started_at is not None and job.finished_at is not None
    assert job.created_at <= job.started_at <= job.finished_at
