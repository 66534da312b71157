"""Admission fixes the revision: channels moving and aliases retiring never change a job."""

from __future__ import annotations

import time
from pathlib import Path

import httpx
import pytest
from redis import Redis

from contracts.jobs import JobStatus
from contracts.queues import Tier, queue_for
from lorafleet.client import JobsClient
from lorafleet.publish import Publisher
from lorafleet.stack import LocalStack
from tests.helpers import async_client, paused, run_jobs
from tests.oracle import PeftOracle

GREEDY = {"max_tokens": 8, "temperature": 0.0, "ignore_eos": True}
PROMPT = "Extract the total amount"


def _submit(api: httpx.Client, name: str) -> dict[str, object]:
    response = api.post("/v1/jobs", json={"adapter": name, "prompt": PROMPT, "sampling": GREEDY})
    assert response.status_code == 202, response.text
    body: dict[str, object] = response.json()
    return body


def _finish(api: httpx.Client, job_ids: list[str]) -> list[dict[str, object]]:
    import asyncio

    async def go() -> list[dict[str, object]]:
        async with async_client(api) as http:
            client = JobsClient(http)
            jobs = await asyncio.gather(*(client.wait(job_id, 300) for job_id in job_ids))
            return [job.model_dump(mode="json") for job in jobs]

    return asyncio.run(go())


@pytest.mark.pauses_consumer
def test_jobs_queued_before_a_channel_moves_run_on_their_admitted_revision(
    stack: LocalStack,
    api: httpx.Client,
    publisher: Publisher,
    fixtures_dir: Path,
    oracle: PeftOracle,
    redis: Redis,
) -> None:
    adapters = fixtures_dir / "adapters"
    first = publisher.publish(adapters / "lora-02-r4-qv", "rev-move-a", Tier.COLD)
    second = publisher.publish(adapters / "lora-07-r8-qkvo", "rev-move-b", Tier.COLD)
    publisher.registry.set_channel("rev-move", first.alias)
    cold = queue_for(Tier.COLD, first.base_model.digest)

    with paused(stack, cold):
        before = [_submit(api, "rev-move") for _ in range(3)]
        assert redis.llen(cold) == 3  # really queued, not running
        publisher.registry.set_channel("rev-move", second.alias)
        after = [_submit(api, "rev-move") for _ in range(3)]
    assert {job["revision"] for job in before} == {first.digest}
    assert {job["channel"] for job in before} == {"rev-move"}
    assert {job["revision"] for job in after} == {second.digest}

    done = _finish(api, [str(job["id"]) for job in before + after])
    expected_first = list(oracle.tokens("lora-02-r4-qv", PROMPT, 8))
    expected_second = list(oracle.tokens("lora-07-r8-qkvo", PROMPT, 8))
    assert expected_first != expected_second
    for job in done[:3]:
        assert job["status"] == "succeeded", job
        assert job["result"]["token_ids"] == expected_first  # type: ignore[index]
        assert job["metadata"]["revision"] == first.digest  # type: ignore[index]
    for job in done[3:]:
        assert job["result"]["token_ids"] == expected_second  # type: ignore[index]
        assert job["metadata"]["loaded_digest"] == second.digest  # type: ignore[index]


@pytest.mark.pauses_consumer
def test_retired_alias_refuses_new_jobs_but_runs_queued_ones(
    stack: LocalStack,
    api: httpx.Client,
    publisher: Publisher,
    fixtures_dir: Path,
    oracle: PeftOracle,
    redis: Redis,
) -> None:
    record = publisher.publish(
        fixtures_dir / "adapters" / "lora-11-r8-qkvo", "rev-retire", Tier.COLD
    )
    publisher.registry.set_channel("rev-retire-chan", record.alias)
    cold = queue_for(Tier.COLD, record.base_model.digest)
    with paused(stack, cold):
        queued = _submit(api, record.alias)
        # A receive the pause caught mid-poll hands its message back to the list: count
        # once the job is visibly waiting there.
        deadline = time.monotonic() + 30
        while not redis.llen(cold):
            assert time.monotonic() < deadline, "the job never showed up in its queue"
            time.sleep(0.05)
        before = redis.llen(cold)
        publisher.registry.retire(record.alias)
        for name in (record.alias, "rev-retire-chan"):
            refused = api.post("/v1/jobs", json={"adapter": name, "prompt": PROMPT})
            assert refused.status_code == 410
            assert refused.json()["error"]["code"] == "adapter_retired"
        assert redis.llen(cold) == before  # nothing enqueued
    (job,) = _finish(api, [str(queued["id"])])
    assert job["status"] == "succeeded"
    assert job["result"]["token_ids"] == list(oracle.tokens("lora-11-r8-qkvo", PROMPT, 8))  # type: ignore[index]


def test_a_channel_resolves_to_its_alias_in_the_answer(
    api: httpx.Client, publisher: Publisher, fixtures_dir: Path
) -> None:
    record = publisher.publish(fixtures_dir / "adapters" / "lora-02-r4-qv", "rev-plain", Tier.COLD)
    publisher.registry.set_channel("rev-plain-chan", record.alias)
    (job,) = run_jobs(api, [("rev-plain-chan", PROMPT)], GREEDY)
    assert job.status == JobStatus.SUCCEEDED
    assert job.adapter == record.alias and job.channel == "rev-plain-chan"
    assert job.metadata is not None and job.metadata.revision == record.digest
