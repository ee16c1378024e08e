"""LLM.chat with tools: the parsed calls come back on the outputs, as the server returns them."""

import json

import jsonschema
import pytest

from jserve import SamplingParams
from jserve.structured import StructuredOutputsParams

from server_utils import TINY_CHAT_TEMPLATE
from test_engine import tiny_llm
from tiny_models import assert_engine_idle

ASK = [{"role": "user", "content": "weather?"}]
# fmt: off
# Bounded arguments: a random model's strings and numbers end within max_tokens only when the schema ends them.
WEATHER = {"type": "function", "function": {"name": "get_weather", "parameters": {
    "type": "object", "properties": {"city": {"enum": ["Paris", "Oslo"]}, "days": {"type": "integer", "minimum": 1,
    "maximum": 7}}, "required": ["city", "days"], "additionalProperties": False}}}
TIME = {"type": "function", "function": {"name": "get_time", "parameters": {
    "type": "object", "properties": {"zone": {"type": "string", "maxLength": 6}}, "required": ["zone"]}}}
# fmt: on
# A template that renders tools itself, tersely: the generic tool prompt does not fit the tiny model's context.
TOOLS_TEMPLATE = "{% if tools %}<s>tools: {% for t in tools %}{{ t.function.name }} {% endfor %}</s>{% endif %}"


@pytest.fixture(scope="module")
def llm(tiny_llama_checkpoint):
    engine = tiny_llm(tiny_llama_checkpoint[0])
    engine.tokenizer.chat_template = TOOLS_TEMPLATE + TINY_CHAT_TEMPLATE
    yield engine
    assert_engine_idle(engine)


def test_forced_calls_come_back_parsed(llm):
    params = [SamplingParams(temperature=1.0, seed=seed, max_tokens=120) for seed in range(4)]
    named = {"type": "function", "function": {"name": "get_weather"}}
    [out] = llm.chat(ASK, params[0], tools=[WEATHER, TIME], tool_choice=named, use_tqdm=False)
    completion = out.outputs[0]
    assert completion.finish_reason == "stop"
    [call] = completion.tool_calls
    assert call.name == "get_weather" and completion.text == ""
    jsonschema.validate(json.loads(call.arguments), WEATHER["function"]["parameters"])
    outs = llm.chat([ASK] * 4, params, tools=[WEATHER, TIME], tool_choice="required", use_tqdm=False)
    finished = [o.outputs[0] for o in outs if o.outputs[0].finish_reason == "stop"]
    assert finished
    for completion in finished:
        assert completion.tool_calls
        for call in completion.tool_calls:
            tool = WEATHER if call.name == "get_weather" else TIME
            jsonschema.validate(json.loads(call.arguments), tool["function"]["parameters"])


def test_a_template_that_renders_tools_gets_them(llm):
    prompt = llm.tokenizer.decode(llm.chat(ASK, SamplingParams(max_tokens=1), tools=[WEATHER, TIME],
                                           tool_choice="none", use_tqdm=False)[0].prompt_token_ids)  # fmt: skip
    assert prompt.startswith("tools: get_weather get_time")


def test_without_tools_nothing_is_parsed(llm):
    [out] = llm.chat(ASK, SamplingParams(temperature=0, max_tokens=5), use_tqdm=False)
    assert out.outputs[0].tool_calls is None
    [out] = llm.chat(
        ASK, SamplingParams(temperature=0, max_tokens=5), tools=[WEATHER], tool_choice="none", use_tqdm=False
    )
    assert out.outputs[0].tool_calls == []


def test_a_forced_call_and_structured_outputs_are_refused_together(llm):
    """As the server refuses them (a 400): the forced call's grammar would replace the caller's, or the other
    way round."""
    named = {"type": "function", "function": {"name": "get_weather"}}
    params = SamplingParams(max_tokens=5, structured_outputs=StructuredOutputsParams(json_object=True))
    for choice in (named, "required"):
        with pytest.raises(ValueError, match="structured_outputs"):
            llm.chat(ASK, params, tools=[WEATHER], tool_choice=choice, use_tqdm=False)
    [out] = llm.chat(ASK, params, tools=[WEATHER], tool_choice="none", use_tqdm=False)  # nothing forced
    assert out.outputs[0].tool_calls == []


def test_a_tool_whose_parameters_are_no_schema_is_named(llm):
    broken = {"type": "function", "function": {"name": "broken", "parameters": {"type": "strin"}}}
    with pytest.raises(ValueError, match="'broken'.*not a valid JSON schema") as error:
        llm.chat(ASK, SamplingParams(max_tokens=5), tools=[WEATHER, broken], tool_choice="required", use_tqdm=False)
    assert error.value.param == "tools"
