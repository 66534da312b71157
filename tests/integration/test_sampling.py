"""Sampling parameters beyond OpenAI's basic ones reach the engine and change its output:
``top_k``, ``min_tokens`` and the three penalties, through the real worker and vLLM."""

from __future__ import annotations

from typing import Any

import httpx

from contracts.registry import AdapterRecord
from tests.helpers import hot_alias, run_jobs

PROMPT = "Extract the total amount"
# Long enough for the greedy output to repeat tokens, which is what penalties act on.
GREEDY: dict[str, Any] = {"max_tokens": 96, "temperature": 0.0, "ignore_eos": True}


def test_top_k_penalties_and_min_tokens_change_the_output(
    api: httpx.Client, published: dict[str, AdapterRecord]
) -> None:
    adapter = hot_alias(published)
    (greedy,) = run_jobs(api, [(adapter, PROMPT)], GREEDY)
    assert greedy.result is not None
    tokens = greedy.result.token_ids
    # Penalties only act on repeated tokens: this output repeats some.
    assert len(set(tokens)) < len(tokens), tokens

    sampled = {"temperature": 1.0, "max_tokens": 96, "ignore_eos": True}
    variants: list[dict[str, Any]] = [
        sampled | {"top_k": 1, "seed": 7},  # top-1 sampling is greedy
        *(sampled | {"seed": seed} for seed in (1, 2, 3)),  # without top_k, it is not
        GREEDY | {"repetition_penalty": 2.0},
        GREEDY | {"presence_penalty": 2.0},
        GREEDY | {"frequency_penalty": 2.0},
    ]
    results = [run_jobs(api, [(adapter, PROMPT)], sampling)[0].result for sampling in variants]
    ids = [result.token_ids if result else None for result in results]
    assert ids[0] == tokens
    assert any(sample != tokens for sample in ids[1:4]), ids[1:4]
    for penalised in ids[4:]:
        assert penalised is not None and penalised != tokens, (penalised, tokens)

    # A stop sequence met by the first token ends the completion there, unless min_tokens.
    first = greedy.result.text.strip()[:1]
    assert first, greedy.result.text
    stopped, held = (
        run_jobs(api, [(adapter, PROMPT)], GREEDY | extra)[0].result
        for extra in ({"stop": [first]}, {"stop": [first], "min_tokens": 6})
    )
    assert stopped is not None and held is not None
    assert stopped.finish_reason == "stop" and stopped.usage.completion_tokens < 6
    assert held.usage.completion_tokens >= 6, held


def test_openai_completions_pass_vllm_parameters_to_the_engine(
    api: httpx.Client, published: dict[str, AdapterRecord]
) -> None:
    body = {"model": hot_alias(published), "prompt": PROMPT, "max_tokens": 96, "ignore_eos": True}
    plain = api.post("/v1/completions", json=body | {"temperature": 0})
    penalised = api.post(
        "/v1/completions", json=body | {"temperature": 0, "repetition_penalty": 2.0}
    )
    top1 = api.post("/v1/completions", json=body | {"temperature": 1.0, "top_k": 1, "seed": 3})
    assert {plain.status_code, penalised.status_code, top1.status_code} == {200}
    text = [answer.json()["choices"][0]["text"] for answer in (plain, penalised, top1)]
    assert text[0] != text[1] and text[0] == text[2], text
