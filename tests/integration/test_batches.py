"""Batches through HTTP against the stack: validation, results in order, cancel, the batch
webhook, and the official ``openai`` client's batch flow."""

from __future__ import annotations

import io
import json
import time
from typing import Any

import httpx
import openai
import pytest
from redis import Redis

from contracts.registry import AdapterRecord
from contracts.tenants import ALL_ADAPTERS, TenantLimits
from contracts.webhooks import batch_event_id
from lorafleet.client import auth_headers
from lorafleet.fixtures import AdapterSpec
from lorafleet.tenants import Tenants
from tests.helpers import LONG_SAMPLING, hot_alias, job_records
from tests.oracle import PeftOracle
from tests.receiver import receiving

PROMPTS = ["Extract the total amount", "Translate the paragraph into", "The quick brown fox"]
MAX_TOKENS = 8
GREEDY = {"max_tokens": MAX_TOKENS, "temperature": 0.0, "ignore_eos": True}


@pytest.fixture(scope="module")
def batch_key(redis: Redis) -> str:
    """A tenant of its own with room for a 1,000-job batch, granted every adapter."""
    tenants = Tenants(redis)
    _, key = tenants.create("batcher", TenantLimits(max_concurrent=5000))
    tenants.grant("batcher", ALL_ADAPTERS)
    return key


@pytest.fixture(scope="module")
def http(gateway_url: str, batch_key: str) -> Any:
    with httpx.Client(base_url=gateway_url, headers=auth_headers(batch_key), timeout=120) as c:
        yield c


def _wait_done(http: httpx.Client, batch_id: str, timeout_s: float = 900) -> dict[str, Any]:
    deadline = time.monotonic() + timeout_s
    while True:
        batch: dict[str, Any] = http.get(f"/v1/batches/{batch_id}").json()
        if batch["status"] in ("completed", "cancelled"):
            return batch
        assert time.monotonic() < deadline, f"batch stuck: {batch}"
        time.sleep(0.5)


def _results(http: httpx.Client, batch_id: str) -> list[dict[str, Any]]:
    response = http.get(f"/v1/batches/{batch_id}/results")
    assert response.status_code == 200
    assert response.headers["content-type"].startswith("application/x-ndjson")
    return [json.loads(line) for line in response.text.splitlines()]


def test_thousand_jobs_over_twelve_adapters_match_their_references_and_fire_one_webhook(
    http: httpx.Client, specs: list[AdapterSpec], oracle: PeftOracle
) -> None:
    assert len(specs) == 12
    lines = [
        {
            "custom_id": f"req-{n}",
            "adapter": specs[n % 12].name,
            "prompt": PROMPTS[(n // 12) % 3],
            "sampling": GREEDY,
        }
        for n in range(1000)
    ]
    with receiving() as receiver:
        created = http.post(
            "/v1/batches", json={"requests": lines, "webhook": {"url": receiver.url()}}
        )
        assert created.status_code == 202, created.text[:2000]
        batch = created.json()
        assert batch["request_counts"]["total"] == 1000 and batch["status"] == "in_progress"
        done = _wait_done(http, batch["id"])
        (call,) = receiver.wait_for(batch_event_id(batch["id"]))
        time.sleep(2)
        assert len(receiver.calls_for(batch_event_id(batch["id"]))) == 1
    assert done["counts"] == {"pending": 0, "succeeded": 1000, "failed": 0, "cancelled": 0}
    assert done["progress"] == 1.0
    event = json.loads(call.body)
    assert event["type"] == "batch.completed" and event["data"]["id"] == batch["id"]
    assert event["data"]["request_counts"] == {"total": 1000, "completed": 1000, "failed": 0}

    results = _results(http, batch["id"])
    assert [r["custom_id"] for r in results] == [line["custom_id"] for line in lines]
    for line, result in zip(lines, results, strict=True):
        assert result["status"] == "succeeded", result
        expected = oracle.tokens(line["adapter"], line["prompt"], MAX_TOKENS)
        assert result["result"]["token_ids"] == list(expected), line["custom_id"]
        assert result["metadata"]["identity_verified"] is True


def test_a_batch_with_bad_lines_is_refused_whole_with_line_numbers(
    http: httpx.Client, redis: Redis, published: dict[str, AdapterRecord]
) -> None:
    good = {"adapter": hot_alias(published), "prompt": "hi"}
    lines = [
        good,
        {"adapter": hot_alias(published)},
        good,
        {"adapter": "no-such-adapter", "prompt": "hi"},
        {**good, "sampling": {"temperature": 7}},
        {**good, "custom_id": "1"},  # the first line's implicit id
    ]
    jobs_before = job_records(redis)
    batches_before = len(list(redis.scan_iter("lorafleet:batch:*")))
    refused = http.post("/v1/batches", json={"requests": lines})
    assert refused.status_code == 422
    error = refused.json()["error"]
    assert error["code"] == "batch_invalid"
    assert "4 of 6 batch lines are invalid" in error["message"]
    assert [(d["line"], d["code"]) for d in error["details"]] == [
        (2, "validation_error"),
        (4, "adapter_not_found"),
        (5, "validation_error"),
        (6, "validation_error"),
    ]
    assert "prompt" in error["details"][0]["message"]
    assert "sampling.temperature" in error["details"][2]["message"]
    assert "used twice" in error["details"][3]["message"]
    assert job_records(redis) == jobs_before
    assert len(list(redis.scan_iter("lorafleet:batch:*"))) == batches_before

    jsonl = b'{"adapter": "x", "prompt": "hi"}\n{not json\n'
    bad_jsonl = http.post(
        "/v1/batches", content=jsonl, headers={"content-type": "application/jsonl"}
    )
    assert bad_jsonl.status_code == 422
    # Every bad line is reported, not only the first one that is not JSON.
    details = bad_jsonl.json()["error"]["details"]
    assert [(d["line"], d["code"]) for d in details] == [
        (1, "adapter_not_found"),
        (2, "validation_error"),
    ]
    # Line numbers are the file's own, blank lines included.
    gap = f'{{"adapter": "{hot_alias(published)}", "prompt": "hi"}}\n\n{{"adapter": "x"}}\n'
    with_gap = http.post(
        "/v1/batches", content=gap.encode(), headers={"content-type": "application/jsonl"}
    )
    assert [d["line"] for d in with_gap.json()["error"]["details"]] == [3]


def test_jsonl_batch_runs_and_cancel_stops_what_has_not_started(
    http: httpx.Client, published: dict[str, AdapterRecord]
) -> None:
    line = {"adapter": hot_alias(published), "prompt": "Summarise", "sampling": LONG_SAMPLING}
    body = "\n".join(json.dumps(line) for _ in range(80)).encode()
    created = http.post("/v1/batches", content=body, headers={"content-type": "application/jsonl"})
    assert created.status_code == 202, created.text
    batch_id = created.json()["id"]
    cancelling = http.delete(f"/v1/batches/{batch_id}")
    assert cancelling.status_code == 200
    assert cancelling.json()["status"] in ("cancelling", "cancelled")
    done = _wait_done(http, batch_id)
    counts = done["counts"]
    assert done["status"] == "cancelled"
    assert counts["cancelled"] > 0 and counts["failed"] == 0
    assert counts["succeeded"] + counts["cancelled"] == 80
    results = _results(http, batch_id)
    assert [r["custom_id"] for r in results] == [str(n) for n in range(1, 81)]
    statuses = {r["status"] for r in results}
    assert statuses <= {"succeeded", "cancelled"}
    assert http.get("/v1/batches/batch_nope").json()["error"]["code"] == "batch_not_found"


def test_openai_client_batch_flow(
    gateway_url: str, batch_key: str, specs: list[AdapterSpec], oracle: PeftOracle
) -> None:
    client = openai.OpenAI(base_url=f"{gateway_url}/v1", api_key=batch_key, max_retries=0)
    requests = [
        {
            "custom_id": f"c{n}",
            "method": "POST",
            "url": "/v1/completions",
            "body": {
                "model": specs[n % 4].name,
                "prompt": PROMPTS[n % 3],
                "max_tokens": MAX_TOKENS,
                "temperature": 0,
                "ignore_eos": True,
            },
        }
        for n in range(12)
    ]
    content = "\n".join(json.dumps(r) for r in requests).encode()
    uploaded = client.files.create(file=("in.jsonl", io.BytesIO(content)), purpose="batch")
    assert uploaded.bytes == len(content)
    batch = client.batches.create(
        input_file_id=uploaded.id, endpoint="/v1/completions", completion_window="24h"
    )
    deadline = time.monotonic() + 300
    while batch.status not in ("completed", "failed", "cancelled"):
        assert time.monotonic() < deadline, batch
        time.sleep(0.5)
        batch = client.batches.retrieve(batch.id)
    assert batch.status == "completed"
    assert batch.request_counts is not None and batch.request_counts.completed == 12
    assert batch.output_file_id is not None
    output = client.files.content(batch.output_file_id).text
    lines = {json.loads(line)["custom_id"]: json.loads(line) for line in output.splitlines()}
    assert set(lines) == {r["custom_id"] for r in requests}
    for request in requests:
        line = lines[request["custom_id"]]
        assert line["error"] is None and line["response"]["status_code"] == 200
        completion = line["response"]["body"]
        expected = oracle.tokens(request["body"]["model"], request["body"]["prompt"], MAX_TOKENS)
        assert completion["choices"][0]["text"] == oracle.decode(expected)
        assert completion["model"] == request["body"]["model"]
    assert batch.error_file_id is not None
    assert client.files.content(batch.error_file_id).text == ""
