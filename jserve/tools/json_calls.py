"""Calls written as JSON objects {"name": ..., "arguments": {...}}, and strict JSON decoding."""

from __future__ import annotations

import json

from jserve.tools.calls import ToolCall, new_call


def _no_constant(name: str) -> object:
    raise ValueError(f"{name} is not JSON")  # NaN and Infinity would make arguments that are not JSON text


_DECODER = json.JSONDecoder(parse_constant=_no_constant)


def decode_at(text: str, pos: int) -> tuple[object, int] | None:
    """The JSON value that starts at text[pos] and where it ends; None when there is none (or it is cut off)."""
    try:
        return _DECODER.raw_decode(text, pos)
    except (ValueError, RecursionError):
        return None


def decode(text: str) -> object:
    """The JSON value that is all of text, whitespace around it aside; None when there is none."""
    text = text.strip()
    decoded = decode_at(text, 0)
    return decoded[0] if decoded is not None and decoded[1] == len(text) else None


def call_from_object(value: object, argument_keys: tuple[str, ...] = ("arguments",)) -> ToolCall | None:
    """The call an object stands for: it needs a non-empty string "name" and an object under the first of
    argument_keys it has. None when it is not a call."""
    if not isinstance(value, dict) or not isinstance(value.get("name"), str) or not value["name"]:
        return None
    key = next((key for key in argument_keys if key in value), None)
    if key is None or not isinstance(value[key], dict):
        return None
    return new_call(value["name"], value[key])
