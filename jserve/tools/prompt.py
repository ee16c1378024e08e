"""Tools and tool-call conversations as a chat template sees them.

A template that renders tools (Qwen2.5's, Llama 3.1's, Hermes', ... they read the `tools` variable) gets them
the way transformers passes them: `tools=[{"type": "function", "function": {...}}]`, and assistant
`tool_calls` whose arguments are objects. A template that does not (SmolLM2's, Llama 2's, most base
models') gets jserve's generic Hermes-style rendering, in plain messages any template can show: the tools
described in the system message, earlier calls as `<tool_call>{json}</tool_call>` text in the assistant's
turn, and tool results as `<tool_response>` text in a user turn. The `hermes` parser reads that format back.
"""

from __future__ import annotations

import json

from jserve.tools.spec import Tool

GENERIC_INSTRUCTIONS = (
    "You may call one or more functions to answer. The functions, as JSON signatures, are:\n<tools>\n{tools}\n"
    "</tools>\nTo call a function, reply with its name and arguments as a JSON object in <tool_call></tool_call> "
    'tags, one call per tag:\n<tool_call>\n{{"name": <function-name>, "arguments": <arguments-object>}}\n</tool_call>'
)


def renders_tools(template: str | None) -> bool:
    """Whether a chat template shows tools itself (it reads the `tools` variable)."""
    return template is not None and "tools" in template


def template_inputs(
    messages: list[dict], tools: tuple[Tool, ...], native: bool
) -> tuple[list[dict], list[dict] | None]:
    """The messages and `tools` to render: as given (native) or in the generic format."""
    if native:
        return [_native(m) for m in messages], [t.for_template() for t in tools] or None
    rendered = [_generic(m) for m in messages]
    if tools:
        description = GENERIC_INSTRUCTIONS.format(tools="\n".join(json.dumps(t.for_template()) for t in tools))
        if rendered and rendered[0]["role"] == "system":
            rendered[0] = {**rendered[0], "content": f"{rendered[0]['content']}\n\n{description}"}
        else:
            rendered.insert(0, {"role": "system", "content": description})
    return rendered, None


def _arguments(call: dict) -> object:
    """A call's arguments as an object, as templates index them (clients send them as JSON text)."""
    arguments = call["function"]["arguments"]
    try:
        return json.loads(arguments) if isinstance(arguments, str) else arguments
    except json.JSONDecodeError:
        return arguments


def _native(message: dict) -> dict:
    if "tool_calls" not in message:
        return message
    calls = [
        {**call, "function": {**call["function"], "arguments": _arguments(call)}} for call in message["tool_calls"]
    ]
    return {**message, "tool_calls": calls}


def _generic(message: dict) -> dict:
    if message["role"] == "tool":
        return {"role": "user", "content": f"<tool_response>\n{message.get('content') or ''}\n</tool_response>"}
    if "tool_calls" not in message:
        return message
    blocks = [
        "<tool_call>\n" + json.dumps({"name": c["function"]["name"], "arguments": _arguments(c)}, ensure_ascii=False)
        + "\n</tool_call>"
        for c in message["tool_calls"]
    ]  # fmt: skip
    text = "\n".join(([message["content"]] if message.get("content") else []) + blocks)
    return {"role": "assistant", "content": text}
