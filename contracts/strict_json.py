"""Strict JSON, for every body, JSONL line and file a client or publisher hands us.

Python's ``json`` accepts what JSON does not (``NaN``, ``Infinity``, ``1e400`` as infinity),
keeps the last of duplicate keys (another reader may keep the first), raises
``UnicodeDecodeError`` on invalid UTF-8 and ``ValueError`` on integers past its digit limit,
decodes ``"\\udcff"`` to a string no encoder takes, and parses nesting deep enough to make
every later walk of the value (validation, fingerprints, dumps) recurse past the
interpreter's limit. Here each is a refusal with a reason (and, for a number, the dotted path
of its field), so no body a client sends becomes a 500 or a crash, and no file a publisher
sends means one thing to us and another to the engine.
"""

from __future__ import annotations

import json
import math
import re
from typing import Any

MAX_DEPTH = 32
"""Deepest nesting of arrays and objects accepted (our own bodies need 4)."""


class JsonRefusal(ValueError):
    """The bytes are not strict JSON; the message says why, for the caller. ``field`` is the
    dotted path of the value at fault, when there is one."""

    def __init__(self, reason: str, field: str | None = None) -> None:
        super().__init__(f"{field}: {reason}" if field else reason)
        self.field = field


class _NonFinite:
    """Stands for a non-finite number until the parse is over and its path can be found."""

    def __init__(self, text: str) -> None:
        self.text = text


def _number(text: str) -> float | _NonFinite:
    value = float(text)
    return value if math.isfinite(value) else _NonFinite(text)


def _unique_keys(pairs: list[tuple[str, Any]]) -> dict[str, Any]:
    result: dict[str, Any] = {}
    for key, value in pairs:
        if key in result:
            raise JsonRefusal(f"key {key!r} appears twice")
        result[key] = value
    return result


_SURROGATE_ESCAPE = re.compile(r"\\u[dD][89a-fA-F]")


def _lone_surrogate(text: str) -> bool:
    try:
        text.encode("utf-8")
    except UnicodeEncodeError:
        return True
    return False


def _walk(value: Any, strings: bool) -> bool:
    """Refuse nesting past ``MAX_DEPTH`` and (``strings``) strings holding a lone surrogate,
    iteratively: no recursion however deep the value. Whether a non-finite number is in it."""
    stack = [(value, 1)]
    non_finite = False
    while stack:
        item, depth = stack.pop()
        if isinstance(item, _NonFinite):
            non_finite = True
        elif strings and isinstance(item, str) and _lone_surrogate(item):
            raise JsonRefusal("a string holds an unpaired surrogate (\\udXXX), not text")
        if isinstance(item, dict):
            children: Any = [*item.keys(), *item.values()] if strings else item.values()
        elif isinstance(item, list):
            children = item
        else:
            continue
        if depth > MAX_DEPTH:
            raise JsonRefusal(f"nested more than {MAX_DEPTH} levels deep")
        stack.extend((child, depth + 1) for child in children)
    return non_finite


def _refuse_first_non_finite(value: Any) -> None:
    """Raise for the first non-finite number in document order, naming its path (only run
    when there is one: building paths costs what the plain walk does not)."""
    pending: list[tuple[str, Any]] = [("", value)]
    while pending:
        path, item = pending.pop()
        if isinstance(item, _NonFinite):
            reason = f"{item.text[:20]} is not a finite number (out of range)"
            raise JsonRefusal(reason, path or None)
        if isinstance(item, dict):
            children = list(item.items())
        elif isinstance(item, list):
            children = list(enumerate(item))
        else:
            continue
        pending.extend(
            (f"{path}.{key}" if path else str(key), child) for key, child in reversed(children)
        )


def loads(raw: bytes | str) -> Any:
    """The value of ``raw``: UTF-8 (never replaced), no ``NaN``/``Infinity``/overflowing
    numbers (the field named), at most ``MAX_DEPTH`` levels deep, no key twice in an object;
    otherwise ``JsonRefusal``."""
    if isinstance(raw, bytes):
        try:
            text = raw.decode("utf-8")
        except UnicodeDecodeError as exc:
            raise JsonRefusal(f"invalid UTF-8 at byte {exc.start}") from exc
    else:
        text = raw
    try:
        value = json.loads(
            text,
            parse_constant=_NonFinite,
            parse_float=_number,
            object_pairs_hook=_unique_keys,
        )
    except JsonRefusal:
        raise
    except json.JSONDecodeError as exc:
        raise JsonRefusal(f"not JSON ({exc.msg} at line {exc.lineno} column {exc.colno})") from exc
    except RecursionError as exc:
        raise JsonRefusal(f"nested more than {MAX_DEPTH} levels deep") from exc
    except ValueError as exc:  # an integer too long to convert, and the like
        raise JsonRefusal(f"not a usable JSON value ({exc})") from exc
    # Only an escape can make a lone surrogate (the text itself is valid UTF-8).
    if _walk(value, strings=_SURROGATE_ESCAPE.search(text) is not None):
        _refuse_first_non_finite(value)
    return value
