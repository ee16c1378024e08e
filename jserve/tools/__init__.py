"""Tool calls: turn a model's output text into OpenAI `tool_calls`, whole or while it streams.

Each format (vLLM's `--tool-call-parser` names: hermes, llama3_json, mistral, pythonic) is a scanner that
settles the output piece by piece (scan.py); parse() and the streamer both just run it, so a streamed
choice adds up to exactly what parse() gives for the whole text, however the text was split.
"""

from jserve.tools.calls import ParsedOutput, StreamDelta, ToolCall, ToolCallDelta, ToolParser, ToolStreamer
from jserve.tools.parsers import TOOL_PARSERS, get_tool_parser

__all__ = [
    "TOOL_PARSERS",
    "ParsedOutput",
    "StreamDelta",
    "ToolCall",
    "ToolCallDelta",
    "ToolParser",
    "ToolStreamer",
    "get_tool_parser",
]
