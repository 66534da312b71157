"""JSON as every reader agrees on it: Python's ``json`` accepts ``NaN``, ``Infinity`` and
``1e999`` (infinite) and keeps the last of duplicate keys, which other readers may not."""

from __future__ import annotations

import json
import math
from typing import Any


class StrictJSONError(ValueError):
    """The text is not JSON every reader parses the same way; ``field`` is the dotted path
    of the value at fault, when there is one."""

    def __init__(self, message: str, field: str | None = None) -> None:
        super().__init__(f"{field}: {message}" if field else message)
        self.field = field


class _NonFinite:
    """Stands for a non-finite number until the parse is over and its path is known."""

    def __init__(self, text: str) -> None:
        self.text = text


def _number(text: str) -> float | _NonFinite:
    value = float(text)
    return value if math.isfinite(value) else _NonFinite(text)


def _unique_keys(pairs: list[tuple[str, Any]]) -> dict[str, Any]:
    result: dict[str, Any] = {}
    for key, value in pairs:
        if key in result:
            raise StrictJSONError(f"key {key!r} appears twice")
        result[key] = value
    return result


def loads(text: str | bytes) -> Any:
    """Parse ``text``; raise ``StrictJSONError`` for a number that is not finite (``NaN``,
    ``Infinity``, ``1e999``; naming its field), duplicate keys, malformed JSON, integers too
    long to convert and nesting too deep to parse."""
    try:
        value = json.loads(
            text, parse_constant=_NonFinite, parse_float=_number, object_pairs_hook=_unique_keys
        )
    except StrictJSONError:
        raise
    except (ValueError, RecursionError) as exc:  # JSONDecodeError, UnicodeDecodeError, digits
        raise StrictJSONError(str(exc) or type(exc).__name__) from exc
    _refuse_non_finite(value)
    return value


def _refuse_non_finite(value: Any) -> None:
    """Raise for the first non-finite number, depth first (a loop: the parser accepts
    nesting deeper than a recursive walk could follow)."""
    pending: list[tuple[str, Any]] = [("", value)]
    while pending:
        path, item = pending.pop()
        if isinstance(item, _NonFinite):
            raise StrictJSONError(f"{item.text} is not a finite number", path or "(top level)")
        if isinstance(item, dict):
            children = list(item.items())
        elif isinstance(item, list):
            children = list(enumerate(item))
        else:
            continue
        pending.extend(
            (f"{path}.{key}" if path else str(key), child) for key, child in reversed(children)
        )
