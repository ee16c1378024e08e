"""Structured outputs over HTTP with the official `openai` client, on the default model (SmolLM2-135M).

`response_format` json_schema (strict) for every schema in structured_cases, json_object, and vLLM's
`structured_outputs` extra (choice, regex, grammar) on both endpoints, streamed and not; bad specs are 400s
naming the field, and leave the engine as it was.
"""

import asyncio
import json
import re
import threading

import jsonschema
import openai
import pytest

from jserve.engine.args import EngineArgs
from jserve.server import ServerSettings

from server_utils import assert_error, assert_server_idle, running_server
from structured_cases import PROMPTS, SCHEMAS

MODEL = "smollm2"


@pytest.fixture(scope="module")
def server(smollm2_gguf_path):
    args = EngineArgs(model=str(smollm2_gguf_path), max_model_len=1024, max_num_seqs=16, kv_cache_memory=256 << 20)
    with running_server(args, ServerSettings(MODEL)) as handle:
        yield handle


@pytest.fixture(autouse=True)
def engine_idle_after(server):
    yield
    assert_server_idle(server)


@pytest.fixture
def client(server):
    return openai.OpenAI(base_url=f"{server.base_url}/v1", api_key="unused", max_retries=0)


def chat(content: str) -> list[dict]:
    return [{"role": "user", "content": content}]


def validate(text: str, schema: dict) -> None:
    checker = jsonschema.Draft202012Validator.FORMAT_CHECKER
    jsonschema.Draft202012Validator(schema, format_checker=checker).validate(json.loads(text))


def test_json_schema_response_format_validates_for_every_schema(server):
    async def ask(aclient, name):
        schema_format = {
            "type": "json_schema",
            "json_schema": {"name": "answer", "schema": SCHEMAS[name], "strict": True},
        }
        reply = await aclient.chat.completions.create(
            model=MODEL, messages=chat(PROMPTS[name]), temperature=0, max_tokens=300, response_format=schema_format
        )
        return name, reply.choices[0]

    async def ask_all():
        async with openai.AsyncOpenAI(base_url=f"{server.base_url}/v1", api_key="unused", max_retries=0) as aclient:
            return await asyncio.gather(*(ask(aclient, name) for name in SCHEMAS))

    replies = asyncio.run(ask_all())
    assert len(replies) >= 20
    unfinished = [(name, c.message.content) for name, c in replies if c.finish_reason != "stop"]
    assert not unfinished
    for name, choice in replies:
        validate(choice.message.content, SCHEMAS[name])


def test_json_object_gives_a_json_object(client):
    reply = client.chat.completions.create(
        model=MODEL, messages=chat('Repeat this JSON exactly: {"name": "Bob", "age": 30}'),
        temperature=0, max_tokens=200,
        response_format={"type": "json_object"},
    )  # fmt: skip
    assert reply.choices[0].finish_reason == "stop", reply.choices[0].message.content
    assert isinstance(json.loads(reply.choices[0].message.content), dict)


def test_structured_outputs_extra_choice_regex_and_grammar(client):
    question = chat("Is the sky blue? Answer yes or no.")
    reply = client.chat.completions.create(
        model=MODEL, messages=question, temperature=0, max_tokens=10,
        extra_body={"structured_outputs": {"choice": ["yes", "no"]}},
    )  # fmt: skip
    assert reply.choices[0].message.content in ("yes", "no")
    pattern = r"[0-9]{3}-[0-9]{4}"
    completion = client.completions.create(
        model=MODEL, prompt="My phone number is ", temperature=0, max_tokens=20,
        extra_body={"structured_outputs": {"regex": pattern}},
    )  # fmt: skip
    assert completion.choices[0].finish_reason == "stop"
    assert re.fullmatch(pattern, completion.choices[0].text)
    grammar = 'start: "Answer: " ("yes" | "no") "."'
    reply = client.chat.completions.create(
        model=MODEL, messages=question, temperature=0.7, seed=3, max_tokens=20, n=2,
        extra_body={"structured_outputs": {"grammar": grammar}},
    )  # fmt: skip
    assert [c.message.content in ("Answer: yes.", "Answer: no.") for c in reply.choices] == [True, True]


def test_a_streamed_constrained_reply_equals_the_whole_one(client):
    kwargs = dict(
        model=MODEL, messages=chat(PROMPTS["product"]), temperature=0, max_tokens=200,
        response_format={"type": "json_schema", "json_schema": {"name": "product", "schema": SCHEMAS["product"]}},
    )  # fmt: skip
    whole = client.chat.completions.create(**kwargs).choices[0].message.content
    streamed = "".join(c.choices[0].delta.content or "" for c in client.chat.completions.create(stream=True, **kwargs))
    assert streamed == whole
    validate(whole, SCHEMAS["product"])


@pytest.mark.parametrize(
    "extra, param, text",
    [
        ({"response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": {"type": 7}}}},
         "response_format", "invalid json"),
        ({"response_format": {"type": "json_schema", "json_schema": {"schema": {}}}}, "response_format", "name"),
        ({"response_format": {"type": "xml"}}, "response_format", "response_format must be"),
        ({"structured_outputs": {"regex": "(unclosed"}}, "structured_outputs", "invalid regex"),
        ({"structured_outputs": {"grammar": "start: nowhere"}}, "structured_outputs", "invalid grammar"),
        ({"structured_outputs": {"choice": "yes"}}, "structured_outputs", "choice must be"),
        ({"structured_outputs": {"regex": "a", "choice": ["a"]}}, "structured_outputs", "exactly one"),
        ({"structured_outputs": {"json_schema": {}}}, "structured_outputs", "unsupported field"),
        ({"structured_outputs": {"regex": "a"}, "response_format": {"type": "json_object"}}, "structured_outputs",
         "not both"),
    ],
)  # fmt: skip
def test_bad_specs_are_400s_naming_the_field(server, extra, param, text):
    import httpx

    for path, body in (("/v1/chat/completions", {"messages": chat("hi")}), ("/v1/completions", {"prompt": "hi"})):
        response = httpx.post(f"{server.base_url}{path}", json={"model": MODEL, "max_tokens": 5, **body, **extra})
        assert_error(response, 400, param, text)


def test_grammars_compile_off_the_engine_thread(server, client, monkeypatch):
    """A slow grammar holds up only its own request: the handler compiles it, the engine finds it cached."""
    grammars = server.engine.info.grammars
    threads = []
    build = grammars._build

    def recording_build(params):
        threads.append(threading.current_thread().name)
        return build(params)

    monkeypatch.setattr(grammars, "_build", recording_build)
    client.completions.create(
        model=MODEL, prompt="Code: ", max_tokens=8, extra_body={"structured_outputs": {"regex": "[A-Z]{2}-[0-9]{3}!"}}
    )
    assert threads and "jserve-engine" not in threads
