"""ToolCalls: one request's way from generated text to content and tool calls, whole or streamed.

Forced calls (tool_choice "required" or named) were generated under a JSON grammar (forced.py) and are read
as JSON once the output is complete; "auto" goes through the server's tool-call parser (keeping only the
first call when parallel tool calls are off); "none" leaves the text as it is.
"""

from __future__ import annotations

from jserve.tools.calls import ParsedOutput, StreamDelta, ToolCallDelta, ToolParser, ToolStreamer
from jserve.tools.forced import forced_calls
from jserve.tools.spec import ToolUse


class ToolCalls:
    def __init__(self, use: ToolUse, parser: ToolParser | None):
        self.use, self.parser = use, parser

    def parse(self, text: str) -> ParsedOutput:
        if self.use.choice.forced:
            calls = forced_calls(text, self.use)
            return ParsedOutput(None, calls) if calls else ParsedOutput(text or None, [])
        if self.use.choice.mode == "auto" and self.parser is not None:
            parsed = self.parser.parse(text)
            return parsed if self.use.parallel else ParsedOutput(parsed.content, parsed.tool_calls[:1])
        return ParsedOutput(text or None, [])

    def streamer(self) -> ToolStreamer:
        if self.use.choice.forced:
            return _HeldToTheEnd(self)
        if self.use.choice.mode == "auto" and self.parser is not None:
            return self.parser.streamer() if self.use.parallel else _FirstCall(self.parser.streamer())
        return _Plain()


class _Plain(ToolStreamer):
    """No tools to read: the text streams as it comes."""

    def feed(self, delta: str) -> StreamDelta:
        return StreamDelta(delta, [])

    def finish(self) -> StreamDelta:
        return StreamDelta("", [])


class _HeldToTheEnd(ToolStreamer):
    """A forced output: JSON that is only calls once complete, so it is held back and parsed at the end."""

    def __init__(self, calls: ToolCalls):
        self._calls, self._text = calls, ""

    def feed(self, delta: str) -> StreamDelta:
        self._text += delta
        return StreamDelta("", [])

    def finish(self) -> StreamDelta:
        parsed = self._calls.parse(self._text)
        deltas = [ToolCallDelta(i, c.id, c.name, c.arguments) for i, c in enumerate(parsed.tool_calls)]
        return StreamDelta(parsed.content or "", deltas)


class _FirstCall(ToolStreamer):
    """A parser's stream with the calls after the first dropped (parallel tool calls off)."""

    def __init__(self, streamer: ToolStreamer):
        self._streamer = streamer

    def feed(self, delta: str) -> StreamDelta:
        return self._first(self._streamer.feed(delta))

    def finish(self) -> StreamDelta:
        return self._first(self._streamer.finish())

    @staticmethod
    def _first(delta: StreamDelta) -> StreamDelta:
        return StreamDelta(delta.content, [d for d in delta.tool_calls if d.index == 0])
