"""A format as a scanner, a function that settles an output piece by piece; parse() and streaming both run it.

A scanner is given the text not settled yet and answers a Step: its next `consumed` characters are this
content, or these calls. Given only a beginning of the output (final=False) it may answer None, "not yet";
any other answer must hold for every continuation of the text: the same calls from the same characters, or
content that the continued text would also settle, perhaps running further (content is settled only where
no markup can begin, so it may be cut anywhere). Given the final text (final=True) it always settles
something. parse() runs the scanner with final=True over the whole text; the streamer runs it over the text
received after each feed(), and with final=True at finish(). Both therefore settle the same calls in the
same order and the same content, only cut differently, which is the streaming contract.
"""

from __future__ import annotations

from abc import abstractmethod
from collections.abc import Callable
from dataclasses import dataclass

from jserve.tools.calls import ParsedOutput, StreamDelta, ToolCall, ToolCallDelta, ToolParser, ToolStreamer


@dataclass(frozen=True)
class Step:
    consumed: int  # characters settled, > 0
    content: str = ""
    calls: tuple[ToolCall, ...] = ()

    def __post_init__(self) -> None:
        if self.consumed <= 0:
            raise ValueError("a scanner step must consume text")  # else the loops below would never end


Scanner = Callable[[str, bool], Step | None]  # (text not settled yet, final) -> Step, or None: not yet


def settle(scan: Scanner, text: str, final: bool) -> tuple[list[Step], str]:
    """Runs scan over text for as long as it settles something: the steps, and the text left unsettled."""
    steps = []
    while text and (step := scan(text, final)) is not None:
        steps.append(step)
        text = text[step.consumed :]
    return steps, text


class ScanningParser(ToolParser):
    """A format given by its scanner."""

    @abstractmethod
    def scanner(self) -> Scanner:
        """A fresh scanner for one output."""

    def parse(self, text: str) -> ParsedOutput:
        steps, _ = settle(self.scanner(), text, final=True)  # a final scan leaves nothing
        content = "".join(step.content for step in steps)
        return ParsedOutput(content if content.strip() else None, [call for step in steps for call in step.calls])

    def streamer(self) -> ToolStreamer:
        return ScanStreamer(self.scanner())


class ScanStreamer(ToolStreamer):
    """Runs a scanner over the text received so far; what it cannot settle yet waits for the next feed()."""

    def __init__(self, scan: Scanner):
        self._scan = scan
        self._pending = ""  # received, not settled
        # Settled content while it is all whitespace: parse() calls that no content (None), so it waits for
        # content that is not. None once that came.
        self._blank: str | None = ""
        self._calls = 0

    def feed(self, delta: str) -> StreamDelta:
        self._pending += delta
        return self._settle(final=False)

    def finish(self) -> StreamDelta:
        return self._settle(final=True)

    def _settle(self, final: bool) -> StreamDelta:
        steps, self._pending = settle(self._scan, self._pending, final)
        content, deltas = [], []
        for step in steps:
            content.append(self._content(step.content))
            for call in step.calls:
                deltas.append(ToolCallDelta(self._calls, call.id, call.name, call.arguments))
                self._calls += 1
        return StreamDelta("".join(content), deltas)

    def _content(self, text: str) -> str:
        if self._blank is None:
            return text
        self._blank += text
        if not self._blank.strip():
            return ""
        text, self._blank = self._blank, None
        return text
