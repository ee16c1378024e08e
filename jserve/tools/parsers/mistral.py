"""mistral: `[TOOL_CALLS]` then a JSON array of {"name": ..., "arguments": {...}} objects, or, in the newer
form, `[TOOL_CALLS]name[ARGS]{...}` once per call. Text around the calls is content.

A "[TOOL_CALLS]" that is not followed by calls is ordinary text: it stays in the content and scanning goes
on right after it. While what follows might still become calls (an unfinished JSON array, say), it is held.
"""

from __future__ import annotations

import re

from jserve.tools.calls import new_call
from jserve.tools.json_calls import call_from_object, decode_at
from jserve.tools.markers import find_marker
from jserve.tools.scan import Scanner, ScanningParser, Step

MARKER, ARGS = "[TOOL_CALLS]", "[ARGS]"
_STRAY = Step(len(MARKER), content=MARKER)
_SPACE = re.compile(r"\s*")
_NAME = re.compile(r"[A-Za-z0-9_.\-]*")


def _step(text: str, final: bool) -> Step | None:
    pos, found = find_marker(text, MARKER, final=final)
    if pos:
        return Step(pos, content=text[:pos])
    if not found:
        return None  # text is the beginning of "[TOOL_CALLS]", or empty
    start = _SPACE.match(text, len(MARKER)).end()
    if start == len(text):
        return _STRAY if final else None
    return (_array if text[start] == "[" else _named)(text, start, final)


def _array(text: str, start: int, final: bool) -> Step | None:
    decoded = decode_at(text, start)  # an array ends at its "]", whatever follows
    if decoded is None:
        return _STRAY if final else None
    calls = [call_from_object(item) for item in decoded[0]]
    if not calls or None in calls:
        return _STRAY
    return Step(decoded[1], calls=tuple(calls))


def _named(text: str, start: int, final: bool) -> Step | None:
    name_end = _NAME.match(text, start).end()
    if not final and len(text) - name_end < len(ARGS) and ARGS.startswith(text[name_end:]):
        return None  # the name or "[ARGS]" is still being written
    if name_end == start or not text.startswith(ARGS, name_end):
        return _STRAY
    args = _SPACE.match(text, name_end + len(ARGS)).end()
    if args == len(text):
        return _STRAY if final else None
    if text[args] != "{":
        return _STRAY
    decoded = decode_at(text, args)  # an object ends at its "}", whatever follows
    if decoded is None:
        return _STRAY if final else None
    call = new_call(text[start:name_end], decoded[0])
    return _STRAY if call is None else Step(decoded[1], calls=(call,))


class MistralParser(ScanningParser):
    name = "mistral"

    def scanner(self) -> Scanner:
        return _step
