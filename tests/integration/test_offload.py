"""Large results live in S3, not Redis, and every way of reading a job gives them back whole.

The session stack's worker offloads results over 512 bytes (``STACK_ENV``): 96 tokens are
well over. Each reader is checked against the PEFT reference: the jobs API, its webhook,
completions (whole and streamed), a batch's results and its OpenAI output file.
"""

from __future__ import annotations

import json
import time
from typing import Any

import httpx
from redis import Redis

from contracts.keys import job_key
from contracts.registry import AdapterRecord
from contracts.webhooks import job_event_id
from lorafleet.stack import LocalStack
from tests.conftest import STACK_ENV
from tests.helpers import hot_alias, job_record, wait_job
from tests.oracle import PeftOracle
from tests.receiver import receiving

PROMPT = "Extract the total amount"
TOKENS = 96
LONG = {"max_tokens": TOKENS, "temperature": 0.0, "ignore_eos": True}


def _offloaded(redis: Redis, s3: Any, stack: LocalStack, job_id: str, text: str) -> None:
    """The job's record holds a reference, not its text, and the object is there."""
    record = job_record(redis, job_id)
    assert record.result is None and record.metadata is not None
    stored = record.metadata.result_stored
    assert stored is not None and stored.key.startswith(f"results/{record.tenant}/sha256/")
    assert stored.size_bytes > int(STACK_ENV["LORAFLEET_RESULT_OFFLOAD_BYTES"])
    raw = redis.hget(job_key(job_id), "record")
    assert isinstance(raw, str) and json.dumps(text)[1:41] not in raw  # as the record spells it
    head = s3.head_object(Bucket=stack.settings.s3_bucket, Key=stored.key)
    assert head["ContentLength"] == stored.size_bytes


def test_jobs_api_and_webhook_give_back_a_result_kept_in_s3(
    api: httpx.Client,
    redis: Redis,
    s3: Any,
    stack: LocalStack,
    published: dict[str, AdapterRecord],
    oracle: PeftOracle,
) -> None:
    alias = hot_alias(published)
    expected = list(oracle.tokens(alias, PROMPT, TOKENS))
    with receiving() as receiver:
        body = {"adapter": alias, "prompt": PROMPT, "sampling": LONG}
        response = api.post("/v1/jobs", json=body | {"webhook": {"url": receiver.url()}})
        assert response.status_code == 202, response.text
        job_id = response.json()["id"]
        job = wait_job(api, job_id)
        (call,) = receiver.wait_for(job_event_id(job_id))
    assert job["status"] == "succeeded", job
    assert job["result"]["token_ids"] == expected
    assert job["metadata"]["result_stored"]["sha256"]
    _offloaded(redis, s3, stack, job_id, job["result"]["text"])
    assert json.loads(call.body)["data"]["result"] == job["result"]


def test_completions_whole_and_streamed_give_back_a_result_kept_in_s3(
    api: httpx.Client,
    redis: Redis,
    s3: Any,
    stack: LocalStack,
    published: dict[str, AdapterRecord],
    oracle: PeftOracle,
) -> None:
    alias = hot_alias(published)
    text = oracle.decode(oracle.tokens(alias, PROMPT, TOKENS))
    body = {"model": alias, "prompt": PROMPT, "max_tokens": TOKENS, "temperature": 0}
    body |= {"ignore_eos": True}
    whole = api.post("/v1/completions", json=body)
    assert whole.status_code == 200, whole.text
    assert whole.json()["choices"][0]["text"] == text
    _offloaded(redis, s3, stack, whole.headers["x-lorafleet-job-id"], text)

    streamed = body | {"stream": True, "stream_options": {"include_usage": True}}
    with api.stream("POST", "/v1/completions", json=streamed) as response:
        assert response.status_code == 200
        job_id = response.headers["x-lorafleet-job-id"]
        events = [
            line.removeprefix("data: ") for line in response.iter_lines() if line.startswith("data")
        ]
    assert events[-1] == "[DONE]"
    chunks = [json.loads(event) for event in events[:-1]]
    assert all("error" not in chunk for chunk in chunks), chunks[-3:]
    assert "".join(c["choices"][0]["text"] for c in chunks if c["choices"]) == text
    assert [c["choices"][0]["finish_reason"] for c in chunks if c["choices"]][-1] == "length"
    assert chunks[-1]["usage"]["completion_tokens"] == TOKENS
    _offloaded(redis, s3, stack, job_id, text)


def test_batch_results_and_output_file_give_back_results_kept_in_s3(
    api: httpx.Client,
    redis: Redis,
    s3: Any,
    stack: LocalStack,
    published: dict[str, AdapterRecord],
    oracle: PeftOracle,
) -> None:
    alias = hot_alias(published)
    expected = list(oracle.tokens(alias, PROMPT, TOKENS))
    line = {"adapter": alias, "prompt": PROMPT, "sampling": LONG}
    requests = [line | {"custom_id": f"r{n}"} for n in range(2)]
    created = api.post("/v1/batches", json={"requests": requests})
    assert created.status_code == 202, created.text
    batch_id = created.json()["id"]
    deadline = time.monotonic() + 300
    while (batch := api.get(f"/v1/batches/{batch_id}").json())["status"] != "completed":
        assert time.monotonic() < deadline, batch
        time.sleep(0.5)

    results = [json.loads(x) for x in api.get(f"/v1/batches/{batch_id}/results").text.splitlines()]
    assert [r["custom_id"] for r in results] == ["r0", "r1"]
    for result in results:
        assert result["status"] == "succeeded" and result["result"]["token_ids"] == expected
        _offloaded(redis, s3, stack, result["job_id"], result["result"]["text"])

    output_id = batch["output_file_id"]
    meta = api.get(f"/v1/files/{output_id}")
    assert meta.status_code == 200, meta.text
    output = api.get(f"/v1/files/{output_id}/content")
    assert output.status_code == 200, output.text
    assert meta.json()["bytes"] == len(output.content)
    lines = [json.loads(x) for x in output.text.splitlines()]
    assert len(lines) == 2
    for out in lines:
        assert out["error"] is None
        assert out["response"]["body"]["result"]["token_ids"] == expected
    # Successes whose results are in S3 are successes: the error file stays empty.
    errors = api.get(f"/v1/files/{batch['error_file_id']}/content")
    assert errors.status_code == 200 and errors.text == ""

    # The output's size is remembered: asking again reads no result (one now gone from the
    # bucket changes nothing), while the content, which must read it, says it is gone.
    key = job_record(redis, results[0]["job_id"]).metadata.result_stored.key  # type: ignore[union-attr]
    s3.delete_object(Bucket=stack.settings.s3_bucket, Key=key)
    again = api.get(f"/v1/files/{output_id}")
    assert again.status_code == 200 and again.json()["bytes"] == len(output.content)
    # The file is whole from the batch's end: that is when it was made, every time.
    assert meta.json()["created_at"] == again.json()["created_at"] == batch["completed_at"]
    gone = api.get(f"/v1/files/{output_id}/content")
    assert gone.status_code == 500 and gone.json()["error"]["code"] == "internal_error"
    assert key in gone.json()["error"]["message"]
