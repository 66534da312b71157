"""Strict JSON refuses, with a reason, everything Python's ``json`` would let through or
crash on."""

from __future__ import annotations

import pytest

from contracts.strict_json import MAX_DEPTH, JsonRefusal, loads


@pytest.mark.parametrize(
    ("raw", "reason"),
    [
        (b'{"a": "\xff"}', "invalid UTF-8"),
        (b'{"a": NaN}', "NaN"),
        (b"[Infinity]", "Infinity"),
        (b"1e400", "out of range"),
        (b"9" * 5000, "usable"),
        (b"[" * 100_000 + b"]" * 100_000, "nested"),
        (b"[" * (MAX_DEPTH + 1) + b"]" * (MAX_DEPTH + 1), "nested"),
        (b'{"a": {"b": "\\udcff"}}', "surrogate"),
        (b'{"\\ud800": 1}', "surrogate"),
        (b'{"a": 1,}', "not JSON"),
        (b'{"model": "a", "model": "b"}', "'model' appears twice"),
        (b'[{"a": {"b": 1, "b": 1}}]', "'b' appears twice"),
        (b"", "not JSON"),
    ],
)
def test_refusals_say_why(raw: bytes, reason: str) -> None:
    with pytest.raises(JsonRefusal, match=reason):
        loads(raw)


def test_valid_json_is_read_as_json() -> None:
    deepest = "[" * MAX_DEPTH + "]" * MAX_DEPTH
    assert loads(deepest.encode())
    assert loads(b'{"emoji": "\\ud83d\\ude00", "x": 1.5e3}') == {"emoji": "\U0001f600", "x": 1500.0}
    assert loads('"\u2028"') == "\u2028"
