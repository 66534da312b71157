"""256 streamed completions at once through the gateway: every one delivers its whole text,
the text the same request gives unstreamed, and none is refused or ends in an error event.

(Before the gateway read every stream over one connection, each stream held a pooled Redis
connection in a blocking read: about a hundred streams took the pool, and the rest ended in
"the job was accepted but its result could not be read".)
"""

from __future__ import annotations

import asyncio
import json
from typing import Any

import aiohttp
import httpx

from contracts.registry import AdapterRecord

STREAMS = 256
MAX_TOKENS = 12
PROMPTS = ("Extract the total amount", "Summarise the invoice", "Translate the date")


async def _stream(
    http: aiohttp.ClientSession, model: str, prompt: str
) -> tuple[int, str, str | None, list[dict[str, Any]], bool]:
    """(status, text, job id, error events, whether [DONE] arrived) of one streamed request."""
    body = {
        "model": model,
        "prompt": prompt,
        "max_tokens": MAX_TOKENS,
        "temperature": 0,
        "ignore_eos": True,
        "stream": True,
    }
    text, errors, done = [], [], False
    async with http.post("/v1/completions", json=body) as response:
        job_id = response.headers.get("x-lorafleet-job-id")
        if response.status != 200:
            return response.status, await response.text(), job_id, errors, done
        async for raw in response.content:
            line = raw.decode().strip()
            if not line.startswith("data: "):
                continue
            data = line.removeprefix("data: ")
            if data == "[DONE]":
                done = True
                continue
            event = json.loads(data)
            if "error" in event:
                errors.append(event["error"])
            for choice in event.get("choices", ()):
                text.append(choice.get("text") or "")
    return 200, "".join(text), job_id, errors, done


def test_256_concurrent_streams_all_deliver_their_whole_text(
    gateway_url: str,
    auth: dict[str, str],
    api: httpx.Client,
    published: dict[str, AdapterRecord],
) -> None:
    hot = sorted(alias for alias, record in published.items() if record.tier == "hot")
    work = [(hot[i % len(hot)], PROMPTS[i % len(PROMPTS)]) for i in range(STREAMS)]

    async def run() -> list[tuple[int, str, str | None, list[dict[str, Any]], bool]]:
        connector = aiohttp.TCPConnector(limit=STREAMS)
        timeout = aiohttp.ClientTimeout(total=600)
        async with aiohttp.ClientSession(
            gateway_url, headers=auth, connector=connector, timeout=timeout
        ) as http:
            return await asyncio.gather(*(_stream(http, model, p) for model, p in work))

    answers = asyncio.run(run())
    refused = [(status, body) for status, body, *_ in answers if status != 200]
    assert not refused, refused[:3]
    errors = [errs for *_, errs, _ in answers if errs]
    assert not errors, errors[:3]
    assert all(done for *_, done in answers)

    unstreamed = {
        pair: api.post(
            "/v1/completions",
            json={
                "model": pair[0],
                "prompt": pair[1],
                "max_tokens": MAX_TOKENS,
                "temperature": 0,
                "ignore_eos": True,
            },
        ).json()["choices"][0]["text"]
        for pair in set(work)
    }
    for pair, (_, text, job_id, _, _) in zip(work, answers, strict=True):
        assert text == unstreamed[pair], (pair, job_id)
        job = api.get(f"/v1/jobs/{job_id}").json()
        assert job["status"] == "succeeded" and job["result"]["text"] == text
