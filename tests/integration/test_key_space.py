"""Every Redis key a workload leaves behind expires, is permanent by design, or is an index
that a named process empties: nothing grows without bound at a fleet's job rate.

The workload touches every kind of key the services write for a job: jobs API jobs (one
with a webhook, one under an idempotency key, one cancelled while queued), OpenAI
completions streamed and not, a batch from an uploaded file. Once it has ended (every job
terminal, the webhook delivered), every key that appeared during it is checked: it has a
TTL, or its name is one of the permanent kinds the README lists (registry, tenants, keys,
grants, ...), or it is an index whose entries a named process removes; for those the test
asserts that none of this workload's jobs (all eight: jobs API, completions, the batch's) or
its webhook event is left in them, nor in a worker's held deliveries or kombu's unacked set.
Keys that existed before it are not checked (other tests' keys share this Redis).
"""

from __future__ import annotations

import io
import json
import re
import time
from typing import Any

import httpx
import openai
from redis import Redis

from contracts.keys import DEADLINES, WEBHOOKS_DUE, held_key, routed_key
from contracts.registry import AdapterRecord
from contracts.webhooks import job_event_id
from tests.helpers import hot_alias, submit_job, wait_job
from tests.receiver import receiving

PERMANENT = {
    # the registry
    r"lorafleet:adapter:.+": "an adapter alias's record",
    r"lorafleet:adapters(:retired)?": "the alias indexes",
    r"lorafleet:channel:.+|lorafleet:channels": "channels",
    r"lorafleet:registry-version|lorafleet:pools": "the registry's version, the pools",
    r"lorafleet:base:.+|lorafleet:tokenizer:.+": "base model cards, tokenizers",
    # tenants, keys, grants
    r"lorafleet:tenant:.+|lorafleet:tenants": "tenants",
    r"lorafleet:apikey:.+|lorafleet:tenant-keys:.+": "API keys",
    r"lorafleet:grants:.+": "grants",
    r"lorafleet:webhook-secrets:.+": "webhook signing secrets",
    # kombu's own: the exchange's bindings
    r"_kombu\.binding\..+": "kombu's queue bindings",
}
EMPTIED = {
    DEADLINES: "the deadline sweeper and every terminal write",
    WEBHOOKS_DUE: "the webhook worker",
    r"lorafleet:ledger:(queue|tenant):.+": "admission's ledgers: every terminal write",
    r"lorafleet:routed:.+": "the claim, and the queue keepers",
    r"lorafleet:held:.+": "the worker's acknowledgement, and the reaper",
    r"lorafleet:workers|lorafleet:worker-queues": "the reapers (a worker gone)",
    r"lorafleet\.(hot|warm|cold)\..+": "the pool queues: workers take their jobs",
    r"unacked(_index)?": "kombu: the acknowledgement, and the restore of a dead worker's",
}


def _kind(key: str, kinds: dict[str, str]) -> str | None:
    return next((what for pattern, what in kinds.items() if re.fullmatch(pattern, key)), None)


def _all_keys(redis: Redis) -> set[str]:
    return {str(key) for key in redis.scan_iter(count=1000)}


def test_every_key_a_workload_leaves_expires_is_permanent_or_is_emptied_by_a_named_process(
    api: httpx.Client,
    gateway_url: str,
    api_key: str,
    redis: Redis,
    published: dict[str, AdapterRecord],
) -> None:
    before = _all_keys(redis)
    alias = hot_alias(published)
    short = {"max_tokens": 4, "temperature": 0.0}
    job_ids: list[str] = []
    client = openai.OpenAI(base_url=f"{gateway_url}/v1", api_key=api_key, max_retries=0)
    with receiving() as receiver:
        body = {"adapter": alias, "prompt": "keys", "sampling": short}
        hooked = api.post("/v1/jobs", json={**body, "webhook": {"url": receiver.url()}})
        assert hooked.status_code == 202, hooked.text
        job_ids.append(hooked.json()["id"])
        again = api.post("/v1/jobs", json=body, headers={"Idempotency-Key": "key-space"})
        assert again.status_code == 202, again.text
        job_ids.append(again.json()["id"])
        cancelled = submit_job(api, alias)["id"]  # a long job, cancelled queued or running
        assert api.delete(f"/v1/jobs/{cancelled}").status_code == 200
        job_ids.append(cancelled)
        four: dict[str, Any] = {
            "max_tokens": 4,
            "temperature": 0.0,
            "extra_body": {"ignore_eos": True},
        }
        text = client.completions.create(model=alias, prompt="keys", **four)
        streamed = list(client.completions.create(model=alias, prompt="keys", stream=True, **four))
        # Both ran to their 4 tokens. Not their text: 4 tokens of the tiny byte-level
        # vocabulary can decode to "" (a split UTF-8 character, a special token).
        assert text.usage is not None and text.usage.completion_tokens == 4, text
        assert [chunk.choices[0].finish_reason for chunk in streamed if chunk.choices][-1] == (
            "length"
        ), streamed
        job_ids += [text.id.removeprefix("cmpl-"), streamed[0].id.removeprefix("cmpl-")]
        lines = [
            {
                "custom_id": f"k{n}",
                "method": "POST",
                "url": "/v1/completions",
                "body": {"model": alias, "prompt": "keys", "max_tokens": 4},
            }
            for n in range(3)
        ]
        content = "\n".join(json.dumps(line) for line in lines).encode()
        uploaded = client.files.create(file=("keys.jsonl", io.BytesIO(content)), purpose="batch")
        batch = client.batches.create(
            input_file_id=uploaded.id, endpoint="/v1/completions", completion_window="24h"
        )
        deadline = time.monotonic() + 300
        while batch.status not in ("completed", "failed", "cancelled"):
            assert time.monotonic() < deadline, batch
            time.sleep(0.2)
            batch = client.batches.retrieve(batch.id)
        assert batch.status == "completed", batch
        assert batch.output_file_id is not None
        output = client.files.content(batch.output_file_id).text.splitlines()
        job_ids += [json.loads(line)["id"].removeprefix("batch_req_") for line in output]
        assert len(job_ids) == 8
        for job_id in job_ids:
            assert wait_job(api, job_id)["status"] in ("succeeded", "cancelled")
        receiver.wait_for(job_event_id(job_ids[0]))
        deadline = time.monotonic() + 60  # the delivery's own bookkeeping, after the answer
        while redis.zscore(WEBHOOKS_DUE, job_event_id(job_ids[0])) is not None:
            assert time.monotonic() < deadline, "the delivered event stayed due"
            time.sleep(0.1)
    new = _all_keys(redis) - before
    for kind in ("job", "stream", "webhook", "batch", "file", "idem"):  # the workload wrote them
        assert any(key.startswith(f"lorafleet:{kind}:") for key in new), (kind, sorted(new))
    unexplained = []
    for key in sorted(new):
        if _kind(key, PERMANENT) or _kind(key, EMPTIED):
            continue
        # -1: no expiry (-2: it expired meanwhile, which is fine)
        if redis.ttl(key) == -1:
            unexplained.append(f"{key} ({redis.type(key)!r})")
    assert not unexplained, "keys that never expire and nothing removes:\n" + "\n".join(unexplained)
    # The indexes hold nothing of this workload any more: every job id, in every index.
    indexes = [DEADLINES, *redis.scan_iter("lorafleet:ledger:*")]
    indexes += list(redis.scan_iter(routed_key("*")))
    for key in indexes:
        for job_id in job_ids:
            assert redis.zscore(key, job_id) is None, (key, job_id)
    # A delivery is released (held) and acknowledged (kombu's unacked) after its job's record
    # is final, and a job cancelled while it ran is final before its worker notices: wait for
    # the worker's bookkeeping, then nothing of this workload may remain in either.
    deadline = time.monotonic() + 60
    while True:
        held = {
            (key, job_id)
            for key in redis.scan_iter(held_key("*"))
            for job_id in redis.hvals(key)  # type: ignore[union-attr]
            if job_id in job_ids
        }
        unacked = " ".join(str(v) for v in redis.hvals("unacked"))  # type: ignore[union-attr]
        left = [job_id for job_id in job_ids if job_id in unacked]
        if not held and not left:
            break
        assert time.monotonic() < deadline, ("held", held, "unacked", left)
        time.sleep(0.1)
