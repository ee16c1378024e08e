"""The tool-call formats by name (vLLM's `--tool-call-parser` values)."""

from jserve.tools.calls import ToolParser
from jserve.tools.parsers.hermes import HermesParser
from jserve.tools.parsers.llama3_json import Llama3JsonParser
from jserve.tools.parsers.mistral import MistralParser
from jserve.tools.parsers.pythonic import PythonicParser

TOOL_PARSERS: dict[str, type[ToolParser]] = {
    parser.name: parser for parser in (HermesParser, Llama3JsonParser, MistralParser, PythonicParser)
}


def get_tool_parser(name: str) -> ToolParser:
    if name not in TOOL_PARSERS:
        raise ValueError(f"unknown tool call parser {name!r}; the parsers are: {', '.join(sorted(TOOL_PARSERS))}")
    return TOOL_PARSERS[name]()


__all__ = ["TOOL_PARSERS", "HermesParser", "Llama3JsonParser", "MistralParser", "PythonicParser", "get_tool_parser"]
