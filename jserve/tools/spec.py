"""The tools a chat request offers and how it lets the model use them, checked and typed.

Field names follow OpenAI's chat API: `tools` (functions with a name, a description, a JSON-schema
`parameters` and `strict`), `tool_choice` ("none" | "auto" | "required" | a named function) and
`parallel_tool_calls`. The legacy `functions` / `function_call` pair maps onto them.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Literal

from jserve.errors import RequestError, short_repr

NAME = re.compile(r"[A-Za-z0-9_.-]{1,64}")
MAX_TOOLS = 128
NO_PARAMETERS = {"type": "object", "properties": {}}


@dataclass(frozen=True)
class Tool:
    name: str
    description: str | None
    parameters: dict  # a JSON schema for the arguments object
    strict: bool = False

    def for_template(self) -> dict:
        """The tool as transformers hands it to a chat template."""
        function = {"name": self.name, "description": self.description, "parameters": self.parameters}
        if self.description is None:
            del function["description"]
        return {"type": "function", "function": function}


@dataclass(frozen=True)
class ToolChoice:
    mode: Literal["none", "auto", "required", "named"]
    name: str | None = None  # the function, when mode is "named"

    @property
    def forced(self) -> bool:
        """The model must call a tool: its output runs under a grammar built from the tools."""
        return self.mode in ("required", "named")


@dataclass(frozen=True)
class ToolUse:
    """What one request allows: its tools, the choice, and whether several calls may come at once."""

    tools: tuple[Tool, ...]
    choice: ToolChoice
    parallel: bool = True

    def tool(self, name: str) -> Tool:
        return next(t for t in self.tools if t.name == name)


def parse_tool_use(body: dict) -> ToolUse | None:
    """The request's tool use, from `tools`/`tool_choice`/`parallel_tool_calls` (or the legacy
    `functions`/`function_call`); None when it offers no tools. Raises RequestError naming the field."""
    if "functions" in body or "function_call" in body:
        if "tools" in body or "tool_choice" in body:
            raise RequestError("give tools/tool_choice or the legacy functions/function_call, not both", "functions")
        body = {"tools": _legacy_tools(body.get("functions")), "tool_choice": _legacy_choice(body.get("function_call"))}
    tools = _tools(body.get("tools"))
    choice = _choice(body.get("tool_choice"), tools)
    parallel = body.get("parallel_tool_calls", True)
    if not isinstance(parallel, bool):
        raise RequestError(f"parallel_tool_calls must be a boolean, got {short_repr(parallel)}", "parallel_tool_calls")
    return ToolUse(tuple(tools), choice, parallel) if tools else None


def _tools(value: object) -> list[Tool]:
    if value is None:
        return []
    if not isinstance(value, list) or len(value) > MAX_TOOLS:
        raise RequestError(f"tools must be a list of at most {MAX_TOOLS} tools", "tools")
    tools = [_tool(entry, i) for i, entry in enumerate(value)]
    names = [t.name for t in tools]
    if len(set(names)) != len(names):
        raise RequestError(f"tools must have distinct names, got {short_repr(names)}", "tools")
    return tools


def _tool(entry: object, i: int) -> Tool:
    if not isinstance(entry, dict) or entry.get("type") != "function" or not isinstance(entry.get("function"), dict):
        raise RequestError(f"tools[{i}] must be {{'type': 'function', 'function': {{...}}}}", "tools")
    function = {key: value for key, value in entry["function"].items() if value is not None}
    unknown = sorted(set(function) - {"name", "description", "parameters", "strict"})
    if unknown:
        raise RequestError(f"tools[{i}].function: unsupported field(s) {short_repr(unknown)}", "tools")
    name = function.get("name")
    if not isinstance(name, str) or not NAME.fullmatch(name):
        raise RequestError(f"tools[{i}].function.name must be 1-64 of a-z, A-Z, 0-9, _ . -, got {short_repr(name)}",
                           "tools")  # fmt: skip
    description = function.get("description")
    if description is not None and not isinstance(description, str):
        raise RequestError(f"tools[{i}].function.description must be a string", "tools")
    parameters = function.get("parameters", NO_PARAMETERS)
    if not isinstance(parameters, dict):
        raise RequestError(f"tools[{i}].function.parameters must be a JSON schema object", "tools")
    strict = function.get("strict", False)
    if not isinstance(strict, bool):
        raise RequestError(f"tools[{i}].function.strict must be a boolean", "tools")
    return Tool(name, description, parameters, strict)


def _choice(value: object, tools: list[Tool]) -> ToolChoice:
    if value is None:
        return ToolChoice("auto" if tools else "none")  # OpenAI's defaults
    if value in ("none", "auto", "required"):
        choice = ToolChoice(value)
    elif isinstance(value, dict) and value.get("type") == "function" and isinstance(value.get("function"), dict):
        choice = ToolChoice("named", value["function"].get("name"))
        if choice.name not in {t.name for t in tools}:
            raise RequestError(f"tool_choice names {short_repr(choice.name)}, which is not in tools", "tool_choice")
    else:
        raise RequestError(
            "tool_choice must be 'none', 'auto', 'required' or {'type': 'function', 'function': {'name': ...}}, "
            f"got {short_repr(value)}",
            "tool_choice",
        )
    if choice.mode != "none" and not tools:
        raise RequestError(f"tool_choice {short_repr(value)} needs tools", "tool_choice")
    return choice


def _legacy_tools(functions: object) -> list[dict] | None:
    if functions is None:
        return None
    if not isinstance(functions, list):
        raise RequestError("functions must be a list of function definitions", "functions")
    return [{"type": "function", "function": f} for f in functions]


def _legacy_choice(function_call: object) -> object:
    if isinstance(function_call, dict):
        return {"type": "function", "function": function_call}
    return function_call
