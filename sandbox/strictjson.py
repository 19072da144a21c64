"""JSON as every other reader takes it, for input from outside (batch lines, payloads, function
arguments): no NaN, Infinity or 1e999, which Python's json reads and no other reader does; and a
depth check for what is later walked recursively (asdict, json.dumps), iterative so that the
check itself cannot overflow the stack."""

from __future__ import annotations

import json
from typing import Any


def utf8_text(text: str) -> str:
    """`text` with each lone surrogate (which Python's JSON writes as an escape and no UTF-8
    reader takes: the MCP SDK, pydantic, most parsers) shown as its escape, `\\udcff`."""
    if text.isascii():
        return text
    try:
        text.encode()
        return text
    except UnicodeEncodeError:
        return text.encode(errors="backslashreplace").decode()


def _no_constant(name: str) -> Any:
    raise ValueError(f"{name} is not JSON")


def _finite(text: str) -> float:
    value = float(text)
    if value in (float("inf"), float("-inf")):  # 1e999: no NaN/Infinity by another name
        raise ValueError(f"{text} is too large a number")
    return value


def _unique(pairs: list[tuple[str, Any]]) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for key, value in pairs:
        if key in out:
            shown = repr(key) if len(key) <= 80 else f"{key[:80]!r}... ({len(key)} characters)"
            raise ValueError(f"key {shown} given more than once in an object")
        out[key] = value
    return out


def loads(text: str | bytes, *, unique_keys: bool = False) -> Any:
    """json.loads, refusing NaN, Infinity and numbers beyond a float (ValueError); with
    `unique_keys`, also an object that names a key twice (json keeps the last, silently)."""
    return json.loads(text, parse_constant=_no_constant, parse_float=_finite,
                      object_pairs_hook=_unique if unique_keys else None)


def _children(value: dict[Any, Any] | list[Any]) -> Any:
    return iter(value.items()) if isinstance(value, dict) else enumerate(value)


def too_deep(obj: Any, limit: int) -> list[str | int] | None:
    """The keys and indexes down to the first array or object that nests deeper than `limit`
    (`obj` itself is depth 1), or None. Memory grows with the depth, not the size."""
    if not isinstance(obj, (dict, list)):
        return None
    path: list[str | int] = []
    stack = [_children(obj)]
    while stack:
        nested = next((kc for kc in stack[-1] if isinstance(kc[1], (dict, list))), None)
        if nested is None:
            stack.pop()
            if path:
                path.pop()
            continue
        if len(stack) >= limit:
            return [*path, nested[0]]
        path.append(nested[0])
        stack.append(_children(nested[1]))
    return None
