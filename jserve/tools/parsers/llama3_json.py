"""llama3_json: the output is `{"name": ..., "parameters": {...}}` (or "arguments"), calls separated by ";",
perhaps after `<|python_tag|>` (Llama 3.1 and later). An output that does not begin with "{" (after whitespace
and the tag) is content; so is one that begins so but is not calls and nothing else.
"""

from __future__ import annotations

import re

from jserve.tools.calls import ToolCall
from jserve.tools.json_calls import call_from_object, decode_at
from jserve.tools.scan import Scanner, ScanningParser
from jserve.tools.whole_output import WholeOutputScanner

TAG = "<|python_tag|>"
ARGUMENT_KEYS = ("parameters", "arguments")
_SPACE = re.compile(r"\s*")


def _body(text: str) -> str:
    return text.lstrip().removeprefix(TAG).lstrip()


def may_be_calls(text: str) -> bool:
    head = text.lstrip()
    return TAG.startswith(head) or _body(text)[:1] in ("", "{")


def parse_calls(text: str) -> list[ToolCall] | None:
    body, pos, calls = _body(text), 0, []
    while True:
        decoded = decode_at(body, pos)
        if decoded is None or (call := call_from_object(decoded[0], ARGUMENT_KEYS)) is None:
            return None
        calls.append(call)
        pos = _SPACE.match(body, decoded[1]).end()
        if pos == len(body):
            return calls
        if body[pos] != ";":
            return None
        pos = _SPACE.match(body, pos + 1).end()
        if pos == len(body):
            return calls  # a ";" may end the last call too


class Llama3JsonParser(ScanningParser):
    name = "llama3_json"

    def scanner(self) -> Scanner:
        return WholeOutputScanner(may_be_calls, parse_calls).step
