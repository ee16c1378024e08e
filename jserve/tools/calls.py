"""What tool-call parsing produces, whole (ParsedOutput) or streamed (StreamDelta), and the parser interface."""

from __future__ import annotations

import json
import secrets
from abc import ABC, abstractmethod
from dataclasses import dataclass
from typing import ClassVar


@dataclass(frozen=True)
class ToolCall:
    id: str
    name: str
    arguments: str  # JSON text of an object


@dataclass(frozen=True)
class ParsedOutput:
    content: str | None  # the text less the call markup; None when only whitespace is left
    tool_calls: list[ToolCall]


@dataclass(frozen=True)
class ToolCallDelta:
    """One piece of a streamed call, in OpenAI's shape."""

    index: int  # which call of the choice: 0, 1, ...
    id: str | None  # on the call's first delta only
    name: str | None  # on the call's first delta only
    arguments: str  # appended to function.arguments ("" allowed)


@dataclass(frozen=True)
class StreamDelta:
    content: str  # appended to the content ("" when none)
    tool_calls: list[ToolCallDelta]


def new_call_id() -> str:
    return f"call_{secrets.token_hex(12)}"


def new_call(name: str, arguments: dict) -> ToolCall | None:
    """A call with a fresh id; None when the arguments are nested too deep to write as JSON."""
    try:
        text = json.dumps(arguments, ensure_ascii=False)
    except RecursionError:  # the decoder may go a little deeper than the encoder
        return None
    return ToolCall(new_call_id(), name, text)


class ToolStreamer(ABC):
    """Parses one choice's output as it is generated.

    Whatever the split of the text into feed() pieces, the content of all deltas adds up to
    `parse(text).content or ""`, and the calls they build are parse(text)'s (ids aside: they are random).
    """

    @abstractmethod
    def feed(self, delta: str) -> StreamDelta:
        """Takes the next piece of generated text; answers what of it (or of text held back) is now settled."""

    @abstractmethod
    def finish(self) -> StreamDelta:
        """At the end of generation: settles everything held back."""


class ToolParser(ABC):
    """One tool-call format."""

    name: ClassVar[str]

    @abstractmethod
    def parse(self, text: str) -> ParsedOutput:
        """A whole output's content and calls. Text that does not parse as a call stays content, unchanged."""

    @abstractmethod
    def streamer(self) -> ToolStreamer:
        """A fresh incremental parser for one choice."""
