"""Hostile and careless HTTP input: each gets a 4xx in OpenAI's error shape, nothing is scheduled, and the
requests of other clients are not touched."""

import asyncio
import json

import httpx
import pytest

from jserve.engine.args import EngineArgs
from jserve.engine.input_batch import InputBatch
from jserve.sampling_params import MAX_STOP_STRINGS
from jserve.server import ServerSettings
from jserve.server.protocol import MAX_PROMPTS
from jserve.server.request_body import MAX_JSON_DEPTH

from server_utils import MODEL, assert_error, assert_server_idle, prompt_ids, running_server, wait_until
from tiny_models import tiny_kv_bytes

KEY = "sesame"
MAX_MODEL_LEN = 128
# Shows each message's name, as chat templates that support names do.
NAMED_TEMPLATE = (
    "{% for m in messages %}<s>{{ m['role'] }}{% if m['name'] %} {{ m['name'] }}{% endif %}: {{ m['content'] }}</s>"
    "{% endfor %}{% if add_generation_prompt %}<s>assistant:{% endif %}"
)
AUTH = {"Authorization": f"Bearer {KEY}"}


@pytest.fixture(scope="module")
def server(tiny_llama_checkpoint):
    args = EngineArgs(model=str(tiny_llama_checkpoint[0]), dtype="float32", max_model_len=MAX_MODEL_LEN, max_num_seqs=4,
                      max_num_batched_tokens=64, kv_cache_memory=tiny_kv_bytes(48))  # fmt: skip
    settings = ServerSettings(MODEL, api_key=KEY, max_queue=8, chat_template=NAMED_TEMPLATE)
    with running_server(args, settings) as handle:
        yield handle


@pytest.fixture(autouse=True)
def engine_idle_after(server):
    yield
    assert_server_idle(server)


def post(server, path: str, body=None, *, content: bytes | None = None, headers=None) -> httpx.Response:
    if content is None:
        content = json.dumps(body).encode()  # ASCII escapes: a lone surrogate travels as \udfff
    headers = {"Content-Type": "application/json"} | AUTH | (headers or {})
    return httpx.post(f"{server.base_url}{path}", content=content, headers=headers, timeout=60)


def greedy(server, prompt: list[int], max_tokens: int = 8) -> list[int]:
    body = {"model": MODEL, "prompt": prompt, "max_tokens": max_tokens, "temperature": 0, "ignore_eos": True,
            "logprobs": 0}  # fmt: skip
    response = post(server, "/v1/completions", body)
    assert response.status_code == 200, response.text
    return response.json()["choices"][0]["logprobs"]["tokens"]


# --- HTTP hygiene --------------------------------------------------------------------------------


@pytest.mark.parametrize("content_type", [None, "text/plain", "application/x-www-form-urlencoded", "text/json"])
def test_post_bodies_must_be_declared_json(server, content_type):
    headers = {"Content-Type": content_type} if content_type else {}
    body = json.dumps({"model": MODEL, "prompt": "x", "max_tokens": 2}).encode()
    response = httpx.post(f"{server.base_url}/v1/completions", content=body, headers=AUTH | headers, timeout=60)
    assert_error(response, 415, text="application/json")
    ok = post(server, "/v1/completions", content=body, headers={"Content-Type": "application/json; charset=utf-8"})
    assert ok.status_code == 200


@pytest.mark.parametrize("given", [None, "Bearer sesam", "Bearer sesame!", "Bearer " + "x" * 1000, "Bearer séсame"])
def test_wrong_api_keys_of_any_length_get_401(server, given):
    headers = {"Authorization": given.encode()} if given else {}
    body = json.dumps({"model": MODEL, "prompt": "x"}).encode()
    response = httpx.post(
        f"{server.base_url}/v1/completions", content=body, headers={"Content-Type": "application/json"} | headers
    )
    assert_error(response, 401)


def test_tokenize_reads_booleans_strictly(server):
    for flag in (True, False):
        assert post(server, "/tokenize", {"prompt": "hello", "add_special_tokens": flag}).status_code == 200
    assert_error(
        post(server, "/tokenize", {"prompt": "hello", "add_special_tokens": "false"}), 400, "add_special_tokens"
    )
    assert_error(post(server, "/tokenize", {"prompt": "x", "nonsense": 1}), 400, "nonsense")


def test_user_is_accepted_and_message_names_reach_the_template(server):
    body = {"model": MODEL, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2, "user": "u-42"}
    assert post(server, "/v1/chat/completions", body).status_code == 200
    assert_error(post(server, "/v1/chat/completions", body | {"user": 42}), 400, "user")
    named = {"messages": [{"role": "user", "name": "alice", "content": "hi"}]}
    tokens = post(server, "/tokenize", named).json()["tokens"]
    text = post(server, "/detokenize", {"tokens": tokens}).json()["prompt"]
    assert "user alice: hi" in text
    assert_error(
        post(server, "/tokenize", {"messages": [{"role": "user", "name": 7, "content": "hi"}]}), 400, "messages"
    )


def test_unknown_message_fields_are_ignored_and_known_ones_still_checked(server):
    """As vLLM: clients and agent frameworks add their own fields to messages (ids, reasoning_content)."""
    messages = [{"role": "user", "content": "hi", "extra_field": 1, "id": "m-1"},
                {"role": "assistant", "content": "yes", "reasoning_content": "thought"},
                {"role": "user", "content": "go on"}]  # fmt: skip
    body = {"model": MODEL, "messages": messages, "max_tokens": 2}
    assert post(server, "/v1/chat/completions", body).status_code == 200
    plain = [{key: m[key] for key in ("role", "content")} for m in messages]
    tokens = post(server, "/tokenize", {"messages": messages}).json()
    assert tokens == post(server, "/tokenize", {"messages": plain}).json()
    odd = {"role": "user", "content": 5, "extra_field": 1}
    assert_error(post(server, "/v1/chat/completions", body | {"messages": [odd]}), 400, "messages", "content")
    assert_error(post(server, "/v1/chat/completions", body | {"extra_field": 1}), 400, "extra_field")


# --- bodies that used to crash handlers ----------------------------------------------------------


@pytest.mark.parametrize(
    "path, body",
    [
        ("/v1/completions", {"model": MODEL, "prompt": "a\udfffb"}),
        ("/v1/completions", {"model": "tiny\ud800"}),
        ("/v1/completions", {"model": MODEL, "prompt": "x", "unknown\udfff": 1}),
        ("/v1/chat/completions", {"model": MODEL, "messages": [{"role": "user", "content": "\udc80"}]}),
        ("/tokenize", {"prompt": "a\udfffb"}),
    ],
)
def test_lone_surrogates_are_400(server, path, body):
    assert_error(post(server, path, body), 400, text="surrogate")


def test_surrogates_in_raw_utf8_bytes_are_400(server):
    content = b'{"model": "tiny", "prompt": "a\xed\xa0\x80b"}'  # UTF-8 of a lone surrogate
    assert_error(post(server, "/v1/completions", content=content), 400, text="surrogate")
    assert_error(post(server, "/v1/completions", content=b'{"prompt": "\xff"}'), 400, text="JSON")


@pytest.mark.parametrize("role", [{"a": 1}, ["user"], 5, None, "tool\udfff", "wizard"])
def test_bad_roles_are_400(server, role):
    body = {"model": MODEL, "messages": [{"role": role, "content": "x"}]}
    assert_error(post(server, "/v1/chat/completions", body), 400)


@pytest.mark.parametrize("depth", [MAX_JSON_DEPTH + 1, 100_000])
def test_deep_nesting_is_400(server, depth):
    content = b'{"model": "tiny", "prompt": ' + b"[" * depth + b"]" * depth + b"}"
    assert_error(post(server, "/v1/completions", content=content), 400, text=f"deeper than {MAX_JSON_DEPTH}")


def test_non_ascii_in_an_error_message_is_returned_intact(server):
    error = assert_error(post(server, "/v1/completions", {"model": "模型", "prompt": "x"}), 404, "model")
    assert "模型" in error["message"]


# --- per-request limits --------------------------------------------------------------------------


@pytest.mark.parametrize(
    "body, param, text",
    [
        ({"max_tokens": MAX_MODEL_LEN}, "max_tokens", f"maximum context length is {MAX_MODEL_LEN}"),
        ({"max_tokens": 16385}, "max_tokens", "too large"),
        ({"n": 5}, "n", "max_num_seqs (4)"),
        ({"n": 16385}, "n", "16385 sequences"),
        ({"prompt": ["a", "b", "c"], "n": 3}, "n", "9 sequences"),
        ({"prompt": ["x"] * (MAX_PROMPTS + 1)}, "prompt", f"at most {MAX_PROMPTS} prompts"),
        ({"stop": ["s"] * (MAX_STOP_STRINGS + 1)}, "stop", f"at most {MAX_STOP_STRINGS} strings"),
        ({"stop": ["x" * 100_000]}, "stop", "characters"),
        ({"top_k": 2**40}, "top_k", "vocabulary size"),
        ({"seed": 2**63}, "seed", ""),
        ({"seed": -(2**63) - 1}, "seed", ""),
        ({"seed": 2**70}, "seed", ""),
        ({"priority": 1}, "priority", "--schedule-policy priority"),
        ({"temperature": float("nan")}, "temperature", "finite"),
        ({"logit_bias": {str(i): 1 for i in range(301)}}, "logit_bias", "300"),
        ({"temperature": 10**400}, "temperature", "finite"),  # an int past float's range
        ({"logit_bias": {"9" * 5000: 1}}, "logit_bias", "token ids"),  # past int()'s 4300 digits
    ],
)
def test_limits_are_400_naming_the_field(server, body, param, text):
    response = post(server, "/v1/completions", {"model": MODEL, "prompt": "hello"} | body)
    assert_error(response, 400, param, text)


def test_chat_names_max_completion_tokens(server):
    body = {"model": MODEL, "messages": [{"role": "user", "content": "x"}], "max_completion_tokens": 10**6}
    assert_error(post(server, "/v1/chat/completions", body), 400, "max_completion_tokens", "too large")


def test_the_largest_request_that_fits_runs(server):
    prompt = prompt_ids(1, 16)
    tokens = greedy(server, prompt, max_tokens=MAX_MODEL_LEN - len(prompt))
    assert len(tokens) == MAX_MODEL_LEN - len(prompt)


# --- one request's engine failure stays its own --------------------------------------------------


def test_a_request_that_fails_in_the_engine_gets_500_and_the_others_finish(server, monkeypatch):
    expected = greedy(server, prompt_ids(2), max_tokens=24)
    original = InputBatch.join  # where a request's own options enter the step's inputs

    def faulty(self, slot, request):
        if request.params.seed == 666:
            raise RuntimeError("injected fault")
        return original(self, slot, request)

    monkeypatch.setattr(InputBatch, "join", faulty)

    async def main():
        async with httpx.AsyncClient(base_url=server.base_url, headers=AUTH, timeout=60) as client:
            good = {"model": MODEL, "prompt": prompt_ids(2), "max_tokens": 24, "temperature": 0, "ignore_eos": True,
                    "logprobs": 0}  # fmt: skip
            bad = {"model": MODEL, "prompt": prompt_ids(3), "max_tokens": 24, "seed": 666}
            return await asyncio.gather(
                client.post("/v1/completions", json=good),
                client.post("/v1/completions", json=bad),
                client.post("/v1/completions", json=bad | {"stream": True}),
            )

    good, bad, streamed = asyncio.run(main())
    assert good.status_code == 200 and good.json()["choices"][0]["logprobs"]["tokens"] == expected
    assert_error(bad, 500, text="other requests were not affected")
    assert streamed.status_code == 200 and '"type": "server_error"' in streamed.text
    assert streamed.text.rstrip().endswith("data: [DONE]")


# --- metrics -------------------------------------------------------------------------------------


def test_an_idle_server_reads_no_kv_usage(server):
    for seed in range(6):
        greedy(server, prompt_ids(seed, 40), max_tokens=4)
    wait_until(lambda: server.metric("num_requests_running") == 0)
    assert server.metric("kv_cache_usage_perc") == 0
    assert server.metric("prefix_cache_usage_perc") > 0  # the prompts' pages stay cached, free to reclaim
