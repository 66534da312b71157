"""Offloaded results: their key, their bytes, and the digest check every reader makes."""

from __future__ import annotations

import hashlib

import pytest

from contracts.jobs import JobResult, Usage
from contracts.storage import StoredResultDamaged, decode_result, encode_result, result_key


def _result(text: str = "a long answer", tokens: int = 5) -> JobResult:
    return JobResult(
        text=text,
        token_ids=list(range(tokens)),
        finish_reason="length",
        usage=Usage(prompt_tokens=3, completion_tokens=tokens, total_tokens=3 + tokens),
    )


def test_a_result_is_stored_under_its_tenant_named_by_its_digest() -> None:
    stored, body = encode_result("acme", _result())
    assert stored.sha256 == hashlib.sha256(body).hexdigest()
    assert (
        stored.key
        == f"results/acme/sha256/{stored.sha256}.json"
        == result_key("acme", stored.sha256)
    )
    assert stored.size_bytes == len(body)
    assert decode_result(stored, body) == _result()
    # Another tenant's identical result is another object: nothing is shared across tenants.
    assert encode_result("other", _result())[0].key != stored.key


@pytest.mark.parametrize(
    "damage",
    [
        lambda body: body[:-1],  # truncated
        lambda body: body.replace(b"long", b"lung"),  # same size, other bytes
        lambda body: body + b" ",  # grown
    ],
)
def test_bytes_that_are_not_the_named_ones_are_refused(damage: object) -> None:
    stored, body = encode_result("acme", _result())
    assert callable(damage)
    with pytest.raises(StoredResultDamaged, match=stored.key):
        decode_result(stored, damage(body))


def test_a_reference_with_another_digest_is_refused() -> None:
    stored, body = encode_result("acme", _result())
    wrong = stored.model_copy(update={"sha256": "0" * 64})
    with pytest.raises(StoredResultDamaged):
        decode_result(wrong, body)
