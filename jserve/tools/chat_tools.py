"""A chat request's tools, prepared once for LLM.chat and the server alike: how its conversations reach the
chat template, and the constraint its output is generated under.

A forced tool choice ("required" or a named function) generates its call under a grammar of the tools'
schemas (forced.py). A constraint of the caller's own (response_format, structured_outputs) would replace
that grammar or be replaced by it, so the two together are refused rather than one of them silently lost.
"""

from __future__ import annotations

from jserve.errors import RequestError
from jserve.structured import StructuredOutputsParams
from jserve.structured.grammar import schema_error
from jserve.tools.forced import forced_constraint
from jserve.tools.prompt import renders_tools, template_inputs
from jserve.tools.spec import ToolUse

CONFLICT = (
    'a forced tool_choice ("required" or a named function) generates its call under the tools\' schemas; it '
    "cannot be combined with a response format or structured_outputs"
)


class ChatTools:
    def __init__(self, use: ToolUse | None, chat_template: str | None):
        """`use`: the request's tools (None: it offers none); `chat_template`: the template it is rendered with."""
        self.use = use
        self.native = renders_tools(chat_template)
        self.forced = _forced_grammar(use) if use is not None and use.choice.forced else None

    def template_inputs(self, messages: list[dict]) -> tuple[list[dict], list[dict] | None]:
        """The messages and the `tools` the chat template renders."""
        return template_inputs(messages, self.use.tools if self.use else (), self.native)

    def constraint(self, given: StructuredOutputsParams | None) -> StructuredOutputsParams | None:
        """What the output is generated under: the caller's constraint, or a forced call's grammar (never
        both: a RequestError naming tool_choice)."""
        if self.forced is None:
            return given
        if given is not None:
            raise RequestError(CONFLICT, "tool_choice")
        return self.forced


def _forced_grammar(use: ToolUse) -> StructuredOutputsParams:
    """The forced call's grammar. A tool whose parameters are no usable schema is named here: the grammar
    compiler would blame a constraint the client never wrote."""
    tools = [use.tool(use.choice.name)] if use.choice.mode == "named" else use.tools
    for tool in tools:
        if error := schema_error(tool.parameters):
            raise RequestError(f"tools: the parameters of function {tool.name!r} are not a valid JSON schema: "
                               f"{error}", "tools")  # fmt: skip
    try:
        return forced_constraint(use)
    except RequestError as error:  # the schemas, together, past the constraint's size limit
        raise RequestError(f"tools: {error}", "tools") from None
