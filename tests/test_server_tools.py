"""Tool calling over HTTP with the official `openai` client: named and required calls on the default model
(its chat template does not render tools, so jserve's generic Hermes-style prompt does), streamed and whole
alike, conversations sent back from the client's own objects, and the 400s."""

import json

import httpx
import jsonschema
import openai
import pytest

from jserve.engine.args import EngineArgs
from jserve.server import ServerSettings

from server_utils import MODEL, assert_error, assert_server_idle, running_server

SMOLLM2 = "smollm2"
WEATHER = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": "Get the current weather in a city",
        "parameters": {
            "type": "object",
            "properties": {
                "city": {"type": "string", "maxLength": 30},
                "unit": {"enum": ["celsius", "fahrenheit"]},
            },
            "required": ["city", "unit"],
            "additionalProperties": False,
        },
    },
}
TIME = {
    "type": "function",
    "function": {
        "name": "get_time",
        "description": "Get the local time in a timezone",
        "parameters": {
            "type": "object",
            "properties": {"timezone": {"type": "string", "maxLength": 30}},
            "required": ["timezone"],
            "additionalProperties": False,
        },
    },
}
TOOLS = [WEATHER, TIME]
ASK = [{"role": "user", "content": "What is the weather like in Paris today?"}]
NAMED = {"type": "function", "function": {"name": "get_weather"}}
BROKEN = {"type": "function", "function": {"name": "broken", "parameters": {"type": "strin"}}}


@pytest.fixture(scope="module")
def server(smollm2_gguf_path):
    args = EngineArgs(model=str(smollm2_gguf_path), max_model_len=1024, max_num_seqs=8, kv_cache_memory=128 << 20)
    settings = ServerSettings(SMOLLM2, enable_auto_tool_choice=True, tool_call_parser="hermes")
    with running_server(args, settings) as handle:
        yield handle


@pytest.fixture(autouse=True)
def engine_idle_after(request):
    yield
    for name in ("server", "tiny_server"):
        if name in request.fixturenames:
            assert_server_idle(request.getfixturevalue(name))


@pytest.fixture
def client(server):
    return openai.OpenAI(base_url=f"{server.base_url}/v1", api_key="unused", max_retries=0)


def valid_call(call, tools=TOOLS) -> dict:
    tool = next(t for t in tools if t["function"]["name"] == call.function.name)
    arguments = json.loads(call.function.arguments)
    jsonschema.validate(arguments, tool["function"]["parameters"])
    assert call.id.startswith("call_") and call.type == "function"
    return arguments


def streamed_calls(stream) -> tuple[str, list[tuple[str, str]], str]:
    """(content, [(name, arguments)], finish_reason) rebuilt from a streamed chat completion."""
    content, calls, finish = "", {}, None
    for chunk in stream:
        for choice in chunk.choices:
            content += choice.delta.content or ""
            for d in choice.delta.tool_calls or []:
                if d.id is not None:
                    calls[d.index] = [d.function.name, ""]
                calls[d.index][1] += d.function.arguments or ""
            finish = choice.finish_reason or finish
    return content, [tuple(c) for _, c in sorted(calls.items())], finish


def test_a_named_tool_choice_returns_a_valid_call_streamed_or_not(client):
    kwargs = dict(model=SMOLLM2, messages=ASK, tools=TOOLS, tool_choice=NAMED, temperature=0, max_tokens=60)
    reply = client.chat.completions.create(**kwargs).choices[0]
    # OpenAI and vLLM end a named call with "stop"; "tool_calls" is for "auto" and "required"
    assert reply.finish_reason == "stop" and reply.message.content is None
    [call] = reply.message.tool_calls
    assert call.function.name == "get_weather"
    valid_call(call)
    content, calls, finish = streamed_calls(client.chat.completions.create(stream=True, **kwargs))
    assert (content, calls, finish) == ("", [(call.function.name, call.function.arguments)], "stop")


@pytest.mark.parametrize("parallel", [True, False])
def test_required_returns_valid_calls(client, parallel):
    reply = client.chat.completions.create(
        model=SMOLLM2, messages=ASK, tools=TOOLS, tool_choice="required", parallel_tool_calls=parallel,
        temperature=0, max_tokens=120,
    ).choices[0]  # fmt: skip
    assert reply.finish_reason == "tool_calls"
    calls = reply.message.tool_calls
    assert len(calls) >= 1 and (parallel or len(calls) == 1)
    for call in calls:
        valid_call(call)


def test_a_three_turn_conversation_from_the_clients_own_objects(client):
    first = client.chat.completions.create(
        model=SMOLLM2, messages=ASK, tools=TOOLS, tool_choice=NAMED, temperature=0, max_tokens=60
    ).choices[0]
    call = first.message.tool_calls[0]
    messages = [
        *ASK,
        first.message.model_dump(),  # refusal, audio, annotations, function_call: all null
        {"role": "tool", "tool_call_id": call.id, "content": json.dumps({"temperature": 21, "sky": "clear"})},
    ]
    answer = client.chat.completions.create(
        model=SMOLLM2, messages=messages, tools=TOOLS, tool_choice="none", temperature=0, max_tokens=30
    ).choices[0]
    assert answer.message.tool_calls is None and answer.message.content
    assert answer.finish_reason in ("stop", "length")


def test_auto_runs_through_the_parser(client):
    reply = client.chat.completions.create(
        model=SMOLLM2, messages=ASK, tools=TOOLS, temperature=0, max_tokens=60
    ).choices[0]
    assert reply.finish_reason in ("stop", "length", "tool_calls")
    for call in reply.message.tool_calls or []:
        valid_call(call)
    assert "<tool_call>" not in (reply.message.content or "") or reply.message.tool_calls is None


def test_auto_needs_the_flag(tiny_server):
    body = {"model": MODEL, "messages": ASK, "tools": TOOLS, "max_tokens": 4}
    response = httpx.post(f"{tiny_server.base_url}/v1/chat/completions", json=body, timeout=60)
    assert_error(response, 400, "tool_choice", "--enable-auto-tool-choice")


@pytest.mark.parametrize(
    "extra, param, text",
    [
        ({"tools": [{"type": "function", "function": {"name": "bad name"}}]}, "tools", "name"),
        ({"tools": TOOLS, "tool_choice": {"type": "function", "function": {"name": "nope"}}}, "tool_choice", "nope"),
        ({"tools": TOOLS, "tool_choice": "required", "response_format": {"type": "json_object"}}, "tool_choice",
         "response format"),
        ({"tools": TOOLS, "tool_choice": NAMED, "structured_outputs": {"regex": "a+"}}, "tool_choice",
         "structured_outputs"),
        ({"tools": [BROKEN], "tool_choice": {"type": "function", "function": {"name": "broken"}}}, "tools",
         "'broken'"),
        ({"tools": [WEATHER, BROKEN], "tool_choice": "required"}, "tools", "'broken'"),
        ({"messages": [{"role": "tool", "content": "x"}]}, "messages", "tool_call_id"),
        ({"messages": [{"role": "assistant", "content": "", "function_call": {"name": "f", "arguments": "{}"}}]},
         "messages", "tool_calls"),
        ({"messages": [{"role": "assistant", "tool_calls": [{"type": "function", "function": {"name": "f"}}]}]},
         "messages", "arguments"),
        ({"messages": [{"role": "user", "content": "hi", "tool_calls": []}]}, "messages", "only assistant"),
    ],
)  # fmt: skip
def test_bad_tool_requests_are_400s(tiny_server, extra, param, text):
    body = {"model": MODEL, "messages": ASK, "max_tokens": 4, "tool_choice": "none"} | extra
    if "tools" not in body:
        body.pop("tool_choice")
    response = httpx.post(f"{tiny_server.base_url}/v1/chat/completions", json=body, timeout=60)
    assert_error(response, 400, param, text)
