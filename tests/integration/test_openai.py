"""The official ``openai`` client against the gateway: models, completions, chat, streaming,
errors; the tokens equal the PEFT reference, and every answer names the revision that ran."""

from __future__ import annotations

from collections.abc import Iterator

import httpx
import openai
import pytest
from redis import Redis

from contracts.registry import AdapterRecord
from lorafleet.fixtures import MAX_POSITION_EMBEDDINGS
from tests.oracle import PeftOracle

PROMPT = "Extract the total amount"
MAX_TOKENS = 8


@pytest.fixture(scope="module")
def client(gateway_url: str, api_key: str) -> Iterator[openai.OpenAI]:
    with openai.OpenAI(base_url=f"{gateway_url}/v1", api_key=api_key, max_retries=0) as client:
        yield client


def _warm(published: dict[str, AdapterRecord]) -> AdapterRecord:
    return next(r for r in published.values() if r.tier == "warm")


def test_models_lists_the_tenants_adapters(
    client: openai.OpenAI, published: dict[str, AdapterRecord]
) -> None:
    listed = {model.id: model for model in client.models.list()}
    assert set(published) <= set(listed)
    warm = _warm(published)
    model = client.models.retrieve(warm.alias)
    assert model.id == warm.alias and model.object == "model"
    # As vLLM's server describes an adapter: its weights (``root``) and base model
    # (``parent``), read as OpenAI's client exposes fields beyond its own.
    for card in (model, listed[warm.alias]):
        assert card.model_extra is not None
        assert card.model_extra["root"] == warm.digest
        assert card.model_extra["parent"] == warm.base_model.id


def test_completion_equals_the_peft_reference_and_names_its_revision(
    client: openai.OpenAI,
    api: httpx.Client,
    published: dict[str, AdapterRecord],
    oracle: PeftOracle,
) -> None:
    record = _warm(published)
    raw = client.completions.with_raw_response.create(
        model=record.alias,
        prompt=PROMPT,
        max_tokens=MAX_TOKENS,
        temperature=0,
        extra_body={"ignore_eos": True},
    )
    assert raw.headers["x-lorafleet-revision"] == record.digest
    completion = raw.parse()
    expected = oracle.tokens(record.alias, PROMPT, MAX_TOKENS)
    assert completion.choices[0].text == oracle.decode(expected)
    assert completion.choices[0].finish_reason == "length"
    assert completion.usage is not None and completion.usage.completion_tokens == MAX_TOKENS
    audit = completion.model_extra["lorafleet"]  # type: ignore[index]
    assert audit["revision"] == record.digest
    assert audit["metadata"]["identity_verified"] is True
    job = api.get(f"/v1/jobs/{audit['job_id']}").json()
    assert job["result"]["token_ids"] == list(expected)
    assert raw.headers["x-lorafleet-job-id"] == audit["job_id"]


def test_streamed_completion_arrives_in_chunks_and_equals_the_whole(
    client: openai.OpenAI, published: dict[str, AdapterRecord], oracle: PeftOracle
) -> None:
    record = _warm(published)
    stream = client.completions.create(
        model=record.alias,
        prompt=PROMPT,
        max_tokens=96,  # long enough that a worker late for all of it is not a pass
        temperature=0,
        stream=True,
        stream_options={"include_usage": True},
        extra_body={"ignore_eos": True},
    )
    chunks = list(stream)
    texts = [c.choices[0].text for c in chunks if c.choices]
    assert len([t for t in texts if t]) > 1, "the text came in one piece"
    assert "".join(texts) == oracle.decode(oracle.tokens(record.alias, PROMPT, 96))
    finishing = [c for c in chunks if c.choices and c.choices[0].finish_reason]
    assert [c.choices[0].finish_reason for c in finishing] == ["length"]
    assert finishing[0].model_extra["lorafleet"]["revision"] == record.digest  # type: ignore[index]
    assert chunks[-1].usage is not None and chunks[-1].usage.completion_tokens == 96


def test_a_completion_sent_again_with_its_idempotency_key_answers_the_same_job(
    api: httpx.Client, published: dict[str, AdapterRecord]
) -> None:
    """The first request mints its job and waits for it from before admitting it; the retry
    finds the key done and waits for (here: reads) the job the first one ran."""
    body = {
        "model": _warm(published).alias,
        "prompt": PROMPT,
        "max_tokens": MAX_TOKENS,
        "temperature": 0,
    }
    headers = {"Idempotency-Key": f"completion-{PROMPT}"}
    first = api.post("/v1/completions", json=body, headers=headers)
    again = api.post("/v1/completions", json=body, headers=headers)
    assert first.status_code == again.status_code == 200
    assert first.headers["x-lorafleet-job-id"] == again.headers["x-lorafleet-job-id"]
    assert first.json()["choices"][0]["text"] == again.json()["choices"][0]["text"]


def test_chat_completion_uses_the_chat_template(
    client: openai.OpenAI, published: dict[str, AdapterRecord], oracle: PeftOracle
) -> None:
    record = _warm(published)
    messages = [
        {"role": "system", "content": "You extract fields."},
        {"role": "user", "content": "Extract the total amount"},
    ]
    raw = client.chat.completions.with_raw_response.create(
        model=record.alias,
        messages=messages,  # type: ignore[arg-type]
        max_tokens=MAX_TOKENS,
        temperature=0,
        extra_body={"ignore_eos": True},
    )
    assert raw.headers["x-lorafleet-revision"] == record.digest
    chat = raw.parse()
    assert chat.object == "chat.completion"
    assert chat.choices[0].message.role == "assistant"
    assert chat.choices[0].message.content
    # The fixture template: <|role|>content</s> per message, then <|assistant|>.
    rendered = "<|system|>You extract fields.</s><|user|>Extract the total amount</s><|assistant|>"
    assert chat.usage is not None
    assert chat.usage.prompt_tokens == len(oracle.encode(rendered))

    stream = client.chat.completions.create(
        model=record.alias,
        messages=messages,  # type: ignore[arg-type]
        max_tokens=MAX_TOKENS,
        temperature=0,
        stream=True,
        extra_body={"ignore_eos": True},
    )
    chunks = list(stream)
    assert chunks[0].choices[0].delta.role == "assistant"
    streamed = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert streamed == chat.choices[0].message.content


def test_errors_come_in_openais_envelope_with_our_code(
    client: openai.OpenAI, redis: Redis, published: dict[str, AdapterRecord]
) -> None:
    before = len(list(redis.scan_iter("lorafleet:job:*")))
    with pytest.raises(openai.NotFoundError) as missing:
        client.completions.create(model="no-such-adapter", prompt="hi")
    assert missing.value.code == "adapter_not_found"
    assert missing.value.type == "not_found_error"
    assert missing.value.param == "model"  # the field that named it here

    with pytest.raises(openai.UnprocessableEntityError) as several:
        client.completions.create(model=_warm(published).alias, prompt="hi", n=2)
    assert several.value.code == "unsupported_parameter"
    assert several.value.param == "n"

    too_long = "invoice total " * MAX_POSITION_EMBEDDINGS
    with pytest.raises(openai.UnprocessableEntityError) as long_prompt:
        client.completions.create(model=_warm(published).alias, prompt=too_long, max_tokens=8)
    assert long_prompt.value.code == "prompt_too_long"
    assert f"context of {MAX_POSITION_EMBEDDINGS} tokens" in long_prompt.value.message

    bad_key = openai.OpenAI(base_url=str(client.base_url), api_key="lf_x_y", max_retries=0)
    with pytest.raises(openai.AuthenticationError) as unauthorized:
        bad_key.models.list()
    assert unauthorized.value.code == "unauthorized"
    assert len(list(redis.scan_iter("lorafleet:job:*"))) == before
