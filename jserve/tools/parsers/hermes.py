"""hermes: `<tool_call>{"name": ..., "arguments": {...}}</tool_call>` blocks among ordinary text (Qwen2.5,
Hermes, jserve's generic template).

A block runs from "<tool_call>" to the first "</tool_call>". One whose JSON is not a call (or that is never
closed) is ordinary text: its "<tool_call>" stays in the content and scanning goes on right after it, so the
rest of it is content too, and well-formed blocks elsewhere in the output are still calls.
"""

from __future__ import annotations

from jserve.tools.json_calls import call_from_object, decode
from jserve.tools.markers import find_marker
from jserve.tools.scan import Scanner, ScanningParser, Step

OPEN, CLOSE = "<tool_call>", "</tool_call>"
_STRAY = Step(len(OPEN), content=OPEN)


def _step(text: str, final: bool) -> Step | None:
    pos, opened = find_marker(text, OPEN, final=final)
    if pos:
        return Step(pos, content=text[:pos])
    if not opened:
        return None  # text is the beginning of "<tool_call>", or empty
    close, closed = find_marker(text, CLOSE, start=len(OPEN), final=final)
    if not closed:
        return _STRAY if final else None
    call = call_from_object(decode(text[len(OPEN) : close]))
    return _STRAY if call is None else Step(close + len(CLOSE), calls=(call,))


class HermesParser(ScanningParser):
    name = "hermes"

    def scanner(self) -> Scanner:
        return _step
