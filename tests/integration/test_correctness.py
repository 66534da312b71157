"""Jobs through gateway -> Redis -> worker -> vLLM produce their adapter's PEFT tokens."""

from __future__ import annotations

import asyncio
from typing import Any

import httpx
import pytest

from contracts.jobs import JobPublic, JobStatus
from contracts.registry import AdapterRecord
from lorafleet.client import JobsClient
from lorafleet.fixtures import AdapterSpec
from tests.helpers import async_client, run_jobs
from tests.oracle import PeftOracle

PROMPTS = ["Extract the total amount", "Translate the paragraph into", "The quick brown fox"]
MAX_TOKENS = 8
GREEDY: dict[str, Any] = {"max_tokens": MAX_TOKENS, "temperature": 0.0, "ignore_eos": True}


def _one_per_kind(specs: list[AdapterSpec]) -> list[AdapterSpec]:
    """One adapter for each (rank, target set) combination: two ranks x two target sets."""
    chosen: dict[tuple[int, tuple[str, ...]], AdapterSpec] = {}
    for spec in specs:
        chosen.setdefault((spec.rank, spec.target_modules), spec)
    return list(chosen.values())


def test_jobs_match_peft_reference_and_differ_from_base(
    api: httpx.Client,
    specs: list[AdapterSpec],
    oracle: PeftOracle,
    published: dict[str, AdapterRecord],
) -> None:
    kinds = _one_per_kind(specs)
    assert len({spec.rank for spec in kinds}) >= 2
    assert len({spec.target_modules for spec in kinds}) >= 2
    work = [(spec.name, prompt) for spec in kinds for prompt in PROMPTS]

    # One adapter at a time: each batch holds a single adapter.
    jobs = []
    for spec in kinds:
        jobs += run_jobs(api, [w for w in work if w[0] == spec.name], GREEDY)

    for (alias, prompt), job in zip(work, jobs, strict=True):
        assert job.status == JobStatus.SUCCEEDED, job.error
        assert job.result is not None and job.metadata is not None
        expected = list(oracle.tokens(alias, prompt, MAX_TOKENS))
        assert job.result.token_ids == expected, f"{alias} / {prompt!r}"
        assert job.result.token_ids != list(oracle.tokens(None, prompt, MAX_TOKENS))
        assert job.metadata.revision == published[alias].digest
        assert job.metadata.loaded_digest == published[alias].digest
        assert job.metadata.identity_verified is True


def test_mixed_adapter_batch_returns_each_adapters_own_tokens(
    api: httpx.Client,
    specs: list[AdapterSpec],
    oracle: PeftOracle,
    published: dict[str, AdapterRecord],
) -> None:
    # Every adapter, several prompts, all submitted before any is awaited: the worker runs
    # them concurrently, so batches mix adapters (and exceed max_loras / max_cpu_loras).
    work = [(spec.name, prompt) for prompt in PROMPTS for spec in specs]
    jobs = run_jobs(api, work, GREEDY)

    wrong = []
    for (alias, prompt), job in zip(work, jobs, strict=True):
        assert job.status == JobStatus.SUCCEEDED, job.error
        assert job.result is not None and job.metadata is not None
        if job.result.token_ids != list(oracle.tokens(alias, prompt, MAX_TOKENS)):
            wrong.append((alias, prompt))
        assert job.metadata.adapter == alias
        assert job.metadata.revision == published[alias].digest
        assert job.metadata.identity_verified is True
    assert wrong == []


@pytest.mark.parametrize("seed", [1, 2])
def test_same_request_twice_gives_identical_tokens(
    api: httpx.Client, specs: list[AdapterSpec], seed: int
) -> None:
    sampling = {"max_tokens": MAX_TOKENS, "temperature": 0.8, "seed": seed, "ignore_eos": True}

    async def twice() -> list[JobPublic]:
        async with async_client(api) as http:
            client = JobsClient(http)
            return [await client.run(specs[0].name, PROMPTS[0], sampling) for _ in range(2)]

    first, second = asyncio.run(twice())
    assert first.result is not None and second.result is not None
    assert first.result.token_ids == second.result.token_ids
