"""Tools for the chat template: validated tool specs, native and generic rendering, forced-call grammars."""

import json

import pytest

from jserve.errors import RequestError
from jserve.tools.extract import ToolCalls
from jserve.tools.forced import forced_calls, forced_constraint
from jserve.tools.parsers import get_tool_parser
from jserve.tools.prompt import renders_tools, template_inputs
from jserve.tools.spec import parse_tool_use

WEATHER = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": "The weather in a city",
        "parameters": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]},
    },
}
TIME = {"type": "function", "function": {"name": "get_time", "parameters": {"type": "object", "properties": {}}}}
CALL = {"id": "call_1", "type": "function", "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'}}
CONVERSATION = [
    {"role": "user", "content": "Weather in Paris?"},
    {"role": "assistant", "content": "", "tool_calls": [CALL]},
    {"role": "tool", "content": "sunny", "tool_call_id": "call_1"},
]


def test_defaults_and_legacy_functions():
    use = parse_tool_use({"tools": [WEATHER, TIME]})
    assert use.choice.mode == "auto" and use.parallel and [t.name for t in use.tools] == ["get_weather", "get_time"]
    assert parse_tool_use({}) is None
    legacy = parse_tool_use({"functions": [WEATHER["function"]], "function_call": {"name": "get_weather"}})
    assert legacy.choice.mode == "named" and legacy.choice.name == "get_weather"
    assert parse_tool_use({"tools": [WEATHER], "tool_choice": "none"}).choice.mode == "none"


@pytest.mark.parametrize(
    "body, param",
    [
        ({"tools": [{"type": "function"}]}, "tools"),
        ({"tools": [{"type": "function", "function": {"name": "has space"}}]}, "tools"),
        ({"tools": [WEATHER, WEATHER]}, "tools"),
        ({"tools": [WEATHER], "tool_choice": "sometimes"}, "tool_choice"),
        ({"tools": [WEATHER], "tool_choice": {"type": "function", "function": {"name": "nope"}}}, "tool_choice"),
        ({"tool_choice": "required"}, "tool_choice"),
        ({"tools": [WEATHER], "parallel_tool_calls": "yes"}, "parallel_tool_calls"),
        ({"tools": [WEATHER], "functions": [WEATHER["function"]]}, "functions"),
    ],
)
def test_bad_tool_specs_name_the_field(body, param):
    with pytest.raises(RequestError) as error:
        parse_tool_use(body)
    assert error.value.param == param


def test_generic_rendering_describes_tools_and_writes_calls_and_results_as_text():
    use = parse_tool_use({"tools": [WEATHER]})
    messages, tools = template_inputs(CONVERSATION, use.tools, native=False)
    assert tools is None
    assert messages[0]["role"] == "system" and "<tools>" in messages[0]["content"]
    assert json.dumps(WEATHER) in messages[0]["content"]
    assert messages[2] == {
        "role": "assistant",
        "content": '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>',
    }
    assert messages[3] == {"role": "user", "content": "<tool_response>\nsunny\n</tool_response>"}
    # the hermes parser reads the generic format back
    assert get_tool_parser("hermes").parse(messages[2]["content"]).tool_calls[0].name == "get_weather"


def test_native_rendering_passes_tools_and_argument_objects():
    use = parse_tool_use({"tools": [WEATHER]})
    messages, tools = template_inputs(CONVERSATION, use.tools, native=True)
    assert tools == [WEATHER]
    assert messages[1]["tool_calls"][0]["function"]["arguments"] == {"city": "Paris"}
    assert messages[2] == CONVERSATION[2]
    assert renders_tools("{% for t in tools %}{{ t }}{% endfor %}") and not renders_tools("{{ messages }}")


def test_forced_grammars_and_their_outputs():
    named = parse_tool_use(
        {"tools": [WEATHER, TIME], "tool_choice": {"type": "function", "function": {"name": "get_weather"}}}
    )
    assert json.loads(forced_constraint(named).json) == WEATHER["function"]["parameters"]
    [call] = forced_calls('{"city": "Oslo"}', named)
    assert call.name == "get_weather" and json.loads(call.arguments) == {"city": "Oslo"}
    required = parse_tool_use({"tools": [WEATHER, TIME], "tool_choice": "required", "parallel_tool_calls": False})
    schema = json.loads(forced_constraint(required).json)
    assert schema["minItems"] == schema["maxItems"] == 1
    assert [b["properties"]["name"]["const"] for b in schema["items"]["anyOf"]] == ["get_weather", "get_time"]
    calls = forced_calls('[{"name": "get_time", "arguments": {}}]', required)
    assert [(c.name, c.arguments) for c in calls] == [("get_time", "{}")]
    assert forced_calls('[{"name": "get_ti', required) is None  # cut off by max_tokens: no calls
    truncated = ToolCalls(required, None).parse('[{"name": "get_ti')
    assert truncated.tool_calls == [] and truncated.content == '[{"name": "get_ti'


def test_streamed_forced_and_plain_outputs_add_up_to_the_whole():
    named = parse_tool_use(
        {"tools": [WEATHER], "tool_choice": {"type": "function", "function": {"name": "get_weather"}}}
    )
    for use, text in ((named, '{"city": "Rome"}'), (parse_tool_use({"tools": [WEATHER], "tool_choice": "none"}), "hi")):
        calls = ToolCalls(use, get_tool_parser("hermes"))
        streamer = calls.streamer()
        pieces = [streamer.feed(ch) for ch in text] + [streamer.finish()]
        whole = calls.parse(text)
        assert "".join(p.content for p in pieces) == (whole.content or "")
        streamed = [(d.name, d.arguments) for p in pieces for d in p.tool_calls]
        assert streamed == [(c.name, c.arguments) for c in whole.tool_calls]


def test_parallel_calls_off_keeps_the_first_call_of_auto():
    text = '<tool_call>{"name": "get_time", "arguments": {}}</tool_call><tool_call>{"name": "get_weather", ' \
        '"arguments": {"city": "Rome"}}</tool_call>'  # fmt: skip
    for parallel, names in ((True, ["get_time", "get_weather"]), (False, ["get_time"])):
        calls = ToolCalls(parse_tool_use({"tools": [WEATHER, TIME], "parallel_tool_calls": parallel}),
                          get_tool_parser("hermes"))  # fmt: skip
        assert [c.name for c in calls.parse(text).tool_calls] == names
        streamer = calls.streamer()
        deltas = [d for ch in text for d in streamer.feed(ch).tool_calls] + streamer.finish().tool_calls
        assert [d.name for d in deltas if d.name] == names
