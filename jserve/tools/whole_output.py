"""Formats where the output is either calls and nothing else, or plain content (llama3_json, pythonic)."""

from __future__ import annotations

from collections.abc import Callable

from jserve.tools.calls import ToolCall
from jserve.tools.scan import Step


class WholeOutputScanner:
    """Holds the output while it may still be calls and decides at the end; once it cannot be (it does not
    begin like calls), it streams as content.

    may_be_calls(text) says whether text may begin calls: once False, it must stay False for every
    continuation, and parse_calls must find no calls in any of them. parse_calls(text) gives the calls the
    whole text is, or None.
    """

    def __init__(self, may_be_calls: Callable[[str], bool], parse_calls: Callable[[str], list[ToolCall] | None]):
        self._may_be_calls = may_be_calls
        self._parse_calls = parse_calls
        self._plain = False

    def step(self, text: str, final: bool) -> Step | None:
        if not self._plain:  # nothing is settled yet: text is the whole output so far
            if not final and self._may_be_calls(text):
                return None
            calls = self._parse_calls(text) if final else None
            if calls:
                return Step(len(text), calls=tuple(calls))
            self._plain = True
        return Step(len(text), content=text)
