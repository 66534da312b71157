"""Strict JSON, for every body, JSONL line and file a client or publisher hands us.

Python's ``json`` accepts what JSON does not (``NaN``, ``Infinity``, ``1e400`` as infinity),
raises ``UnicodeDecodeError`` on invalid UTF-8 and ``ValueError`` on integers past its digit
limit, decodes ``"\\udcff"`` to a string no encoder takes, and parses nesting deep enough to
make every later walk of the value (validation, fingerprints, dumps) recurse past the
interpreter's limit. Here each is a refusal with a reason, so no body a client sends becomes
a 500 or a crash.
"""

from __future__ import annotations

import json
import math
import re
from typing import Any

MAX_DEPTH = 32
"""Deepest nesting of arrays and objects accepted (our own bodies need 4)."""


class JsonRefusal(ValueError):
    """The bytes are not strict JSON; the message says why, for the caller."""


def _constant(name: str) -> Any:
    raise JsonRefusal(f"{name} is not a JSON value")


def _finite(text: str) -> float:
    value = float(text)
    if not math.isfinite(value):
        raise JsonRefusal(f"{text[:20]} is out of range")
    return value


_SURROGATE_ESCAPE = re.compile(r"\\u[dD][89a-fA-F]")


def _lone_surrogate(text: str) -> bool:
    try:
        text.encode("utf-8")
    except UnicodeEncodeError:
        return True
    return False


def _walk(value: Any, strings: bool) -> None:
    """Refuse nesting past ``MAX_DEPTH`` and (``strings``) strings holding a lone surrogate,
    iteratively: no recursion however deep the value."""
    stack = [(value, 1)]
    while stack:
        item, depth = stack.pop()
        if strings and isinstance(item, str) and _lone_surrogate(item):
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


def loads(raw: bytes | str) -> Any:
    """The value of ``raw``: UTF-8 (never replaced), no ``NaN``/``Infinity``, at most
    ``MAX_DEPTH`` levels deep; otherwise ``JsonRefusal``."""
    if isinstance(raw, bytes):
        try:
            text = raw.decode("utf-8")
        except UnicodeDecodeError as exc:
            raise JsonRefusal(f"invalid UTF-8 at byte {exc.start}") from exc
    else:
        text = raw
    try:
        value = json.loads(text, parse_constant=_constant, parse_float=_finite)
    except JsonRefusal:
        raise
    except json.JSONDecodeError as exc:
        raise JsonRefusal(f"not JSON ({exc.msg} at line {exc.lineno} column {exc.colno})") from exc
    except RecursionError as exc:
        raise JsonRefusal(f"nested more than {MAX_DEPTH} levels deep") from exc
    except ValueError as exc:  # an integer too long to convert, and the like
        raise JsonRefusal(f"not a usable JSON value ({exc})") from exc
    # Only an escape can make a lone surrogate (the text itself is valid UTF-8).
    _walk(value, strings=_SURROGATE_ESCAPE.search(text) is not None)
    return value
