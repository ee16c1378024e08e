"""Forced tool calls: with tool_choice "required" or a named function, the output runs under a JSON grammar
built from the tools' schemas, so the calls always parse and their arguments validate.

A named function's output is its arguments object; "required" gives a JSON array of
{"name": ..., "arguments": {...}} (exactly one item when parallel tool calls are off). Both are compact
JSON: the arguments are read by a program, and whitespace is only room for a small model to wander.
"""

from __future__ import annotations

import json

from jserve.structured import StructuredOutputsParams
from jserve.tools.calls import ToolCall, new_call_id
from jserve.tools.spec import ToolUse


def forced_constraint(use: ToolUse) -> StructuredOutputsParams:
    if use.choice.mode == "named":
        return StructuredOutputsParams(json=use.tool(use.choice.name).parameters, disable_any_whitespace=True)
    calls = {
        "anyOf": [
            {
                "type": "object",
                "properties": {"name": {"const": tool.name}, "arguments": tool.parameters},
                "required": ["name", "arguments"],
                "additionalProperties": False,
            }
            for tool in use.tools
        ]
    }
    schema = {"type": "array", "items": calls, "minItems": 1}
    if not use.parallel:
        schema["maxItems"] = 1
    return StructuredOutputsParams(json=schema, disable_any_whitespace=True)


def forced_calls(text: str, use: ToolUse) -> list[ToolCall] | None:
    """The calls in a forced output; None if it does not parse (generation stopped early, by max_tokens)."""
    try:
        value = json.loads(text)
    except json.JSONDecodeError:
        return None
    items = [{"name": use.choice.name, "arguments": value}] if use.choice.mode == "named" else value
    return [ToolCall(new_call_id(), item["name"], json.dumps(item["arguments"], ensure_ascii=False)) for item in items]
