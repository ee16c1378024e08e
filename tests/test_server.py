"""The OpenAI-compatible server, driven over HTTP by the official `openai` client and by httpx; every test
runs against a plain server and ones started with --speculative-config (n-gram, and a draft model)."""

import asyncio
import json
import socket
import threading
from dataclasses import dataclass, replace
from importlib.metadata import version

import httpx
import numpy as np
import openai
import pytest

import jserve
from jserve.engine.args import EngineArgs
from jserve.server import ServerSettings
from jserve.server.async_engine import Submission

from server_utils import (
    MODEL,
    TINY_CHAT_TEMPLATE,
    assert_error,
    assert_server_idle,
    prompt_ids,
    running_server,
    wait_until,
)
from tiny_models import VOCAB_SIZE, assert_engine_idle, reference_greedy, tiny_engine_args

NGRAM = '{"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_max": 4, "prompt_lookup_min": 1}'


@pytest.fixture(scope="module", params=["plain", "ngram", "draft"])
def server(request, tiny_llama_checkpoint):
    folder = tiny_llama_checkpoint[0]
    args = tiny_engine_args(folder)
    if request.param == "ngram":
        args = replace(args, speculative_config=NGRAM)
    if request.param == "draft":  # the model as its own draft, its K/V beside the target's in as many pages
        draft = json.dumps({"model": str(folder), "num_speculative_tokens": 3})
        args = replace(args, speculative_config=draft, kv_cache_memory=2 * args.kv_cache_memory)
    with running_server(args, ServerSettings(MODEL, chat_template=TINY_CHAT_TEMPLATE)) as handle:
        yield handle


@pytest.fixture(autouse=True)
def engine_idle_after(request):
    """After every test: nothing in flight, every KV page back in the pool (once aborts have landed)."""
    yield
    if "server" in request.fixturenames:
        assert_server_idle(request.getfixturevalue("server"))


@pytest.fixture
def client(server):
    return openai.OpenAI(base_url=f"{server.base_url}/v1", api_key="unused", max_retries=0)


def post(server, path: str, **kwargs) -> httpx.Response:
    return httpx.post(f"{server.base_url}{path}", **{"timeout": 60} | kwargs)


# --- happy paths ---------------------------------------------------------------------------------


def test_models_health_version(server, client):
    assert [m.id for m in client.models.list().data] == [MODEL]
    assert httpx.get(f"{server.base_url}/health").json() == {"status": "ready"}
    installed = version("jserve")
    assert jserve.__version__ == installed  # pyproject.toml and jserve/__init__.py agree
    assert httpx.get(f"{server.base_url}/version").json() == {"version": installed}


def test_greedy_completion_matches_transformers(server, client, tiny_llama_checkpoint):
    ids = prompt_ids(0)
    expected = reference_greedy(tiny_llama_checkpoint[1], ids, 16)
    out = client.completions.create(
        model=MODEL, prompt=ids, max_tokens=16, temperature=0, logprobs=0, extra_body={"ignore_eos": True}
    )
    choice = out.choices[0]
    assert choice.finish_reason == "length"
    tokenizer = server.engine.info.tokenizer
    assert choice.text == tokenizer.decode(expected)
    assert choice.logprobs.tokens == [tokenizer.decode([t], skip_special_tokens=False) for t in expected]
    assert out.usage.prompt_tokens == len(ids) and out.usage.completion_tokens == 16
    assert out.usage.total_tokens == len(ids) + 16


def test_streamed_completion_equals_the_whole_one(client):
    kwargs = dict(
        model=MODEL, prompt=["hello there", "a b c"], max_tokens=20, temperature=0, extra_body={"ignore_eos": True}
    )
    whole = client.completions.create(**kwargs)
    texts, finishes = {0: "", 1: ""}, {}
    chunks = list(client.completions.create(stream=True, stream_options={"include_usage": True}, **kwargs))
    for chunk in chunks[:-1]:
        for c in chunk.choices:
            texts[c.index] += c.text
            if c.finish_reason:
                finishes[c.index] = c.finish_reason
    assert texts == {c.index: c.text for c in whole.choices}
    assert finishes == {0: "length", 1: "length"}
    usage = chunks[-1]
    assert usage.choices == [] and usage.usage.completion_tokens == 40
    assert usage.usage.prompt_tokens == whole.usage.prompt_tokens
    assert usage.usage.prompt_tokens_details.cached_tokens == 0


def test_continuous_usage_stats_put_the_usage_so_far_on_every_chunk(server, client):
    """vLLM's stream option: each chunk carries the usage up to it (the role chunk's counts the prompt only),
    before the final usage chunk; on both routes."""
    options = {"include_usage": True, "continuous_usage_stats": True}
    kwargs = dict(model=MODEL, max_tokens=8, temperature=0, stream=True, stream_options=options,
                  extra_body={"ignore_eos": True})  # fmt: skip
    prompt = prompt_ids(5)
    chat = [{"role": "user", "content": "count"}]
    chat_prompt = post(server, "/tokenize", json={"messages": chat}).json()["count"]
    for chunks, prompt_tokens in (
        (list(client.completions.create(prompt=prompt, **kwargs)), len(prompt)),
        (list(client.chat.completions.create(messages=chat, **kwargs)), chat_prompt),
    ):
        *streamed, final = chunks
        assert final.choices == [] and final.usage.completion_tokens == 8
        generated = [chunk.usage.completion_tokens for chunk in streamed]
        assert generated == sorted(generated) and generated[-1] == 8
        assert all(chunk.usage.prompt_tokens == prompt_tokens for chunk in chunks)
        assert all(c.usage.total_tokens == c.usage.prompt_tokens + c.usage.completion_tokens for c in chunks)
    assert generated[0] == 0  # the chat's role chunk


def test_stream_events_survive_clients_that_split_on_unicode_line_breaks():
    # A model can emit U+2028, U+0085 or a form feed; httpx's aiter_lines splits on all of them.
    from jserve.server.app import _sse

    text = "a\u2028b\x85c\x0cd\u2029e\x1cf\r\ng"
    event = _sse({"choices": [{"text": text}]})
    line, blank = event.splitlines()
    assert blank == "" and event.endswith("\n\n")
    assert json.loads(line.removeprefix("data: "))["choices"][0]["text"] == text


def test_chat_stream_starts_with_the_role_and_matches_the_whole_reply(client):
    messages = [
        {"role": "system", "content": "be brief"},
        {"role": "user", "content": [{"type": "text", "text": "hi"}]},
    ]
    kwargs = dict(model=MODEL, messages=messages, max_tokens=12, temperature=0, extra_body={"ignore_eos": True})
    whole = client.chat.completions.create(**kwargs)
    assert whole.choices[0].message.role == "assistant"
    chunks = list(client.chat.completions.create(stream=True, **kwargs))
    assert chunks[0].choices[0].delta.role == "assistant"
    assert "".join(c.choices[0].delta.content or "" for c in chunks) == whole.choices[0].message.content
    assert chunks[-1].choices[0].finish_reason == "length"
    assert all(c.choices[0].finish_reason is None for c in chunks[:-1])


def test_n_and_seed(client):
    kwargs = dict(
        model=MODEL, prompt="seeded", max_tokens=10, temperature=1.0, n=3, seed=7, extra_body={"ignore_eos": True}
    )
    first, second = client.completions.create(**kwargs), client.completions.create(**kwargs)
    assert sorted(c.index for c in first.choices) == [0, 1, 2]
    assert [c.text for c in first.choices] == [c.text for c in second.choices]
    assert len({c.text for c in first.choices}) > 1  # each completion has its own seed
    other = client.completions.create(**(kwargs | {"seed": 8}))
    assert [c.text for c in other.choices] != [c.text for c in first.choices]


def test_logprobs(client):
    out = client.completions.create(
        model=MODEL, prompt="x y", max_tokens=6, temperature=0, logprobs=3, extra_body={"ignore_eos": True}
    )
    lp = out.choices[0].logprobs
    assert len(lp.tokens) == len(lp.token_logprobs) == len(lp.top_logprobs) == 6
    for token, logprob, top in zip(lp.tokens, lp.token_logprobs, lp.top_logprobs, strict=True):
        assert logprob <= 0 and top[token] == pytest.approx(logprob)  # greedy: the choice is the top one
        assert max(top.values()) == pytest.approx(logprob)
    assert lp.text_offset == list(np.cumsum([0] + [len(t) for t in lp.tokens[:-1]]))

    chat = client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "q"}], max_tokens=5,
                                          temperature=0, logprobs=True, top_logprobs=2,
                                          extra_body={"ignore_eos": True})  # fmt: skip
    content = chat.choices[0].logprobs.content
    assert len(content) == 5
    for item in content:
        assert [t.logprob for t in item.top_logprobs] == sorted((t.logprob for t in item.top_logprobs), reverse=True)
        assert len(item.top_logprobs) == 2 and item.top_logprobs[0].logprob == pytest.approx(item.logprob)
        assert item.bytes == list(item.token.encode())


def test_stop_string_is_excluded(client):
    base = client.completions.create(model=MODEL, prompt="stop test", max_tokens=24, temperature=0,
                                     extra_body={"ignore_eos": True}).choices[0].text  # fmt: skip
    stop = base[len(base) // 2 : len(base) // 2 + 2]
    assert stop.strip(), f"pick a prompt whose output has text to stop on: {base!r}"
    for stream in (False, True):
        out = client.completions.create(model=MODEL, prompt="stop test", max_tokens=24, temperature=0, stop=[stop],
                                        stream=stream, extra_body={"ignore_eos": True})  # fmt: skip
        if stream:
            chunks = list(out)
            text, finish = "".join(c.choices[0].text for c in chunks), chunks[-1].choices[0].finish_reason
        else:
            text, finish = out.choices[0].text, out.choices[0].finish_reason
        assert text == base[: base.index(stop)] and finish == "stop"


def test_echo_prepends_the_prompt(client):
    kwargs = dict(model=MODEL, prompt="echo me", max_tokens=4, temperature=0, extra_body={"ignore_eos": True})
    plain = client.completions.create(**kwargs)
    assert plain.usage.completion_tokens == 4 and plain.choices[0].text
    echoed = client.completions.create(echo=True, **kwargs)
    assert echoed.choices[0].text == "echo me" + plain.choices[0].text
    assert echoed.usage == plain.usage  # the echoed prompt is not generated again
    streamed = "".join(c.choices[0].text for c in client.completions.create(echo=True, stream=True, **kwargs))
    assert streamed == "echo me" + plain.choices[0].text


def test_tokenize_detokenize(server):
    tokenizer = server.engine.info.tokenizer
    ids = tokenizer.encode("hello world")
    tokens = post(server, "/tokenize", json={"prompt": "hello world"}).json()
    assert tokens == {"count": len(ids), "max_model_len": 256, "tokens": ids}
    assert post(server, "/detokenize", json={"tokens": ids}).json() == {"prompt": tokenizer.decode(ids)}
    chat = post(server, "/tokenize", json={"messages": [{"role": "user", "content": "hi"}]}).json()
    # TINY_CHAT_TEMPLATE's rendering, which writes its own <s>: no BOS is added on top
    chat_ids = tokenizer.encode("<s>user: hi</s><s>assistant:", add_special_tokens=False)
    assert chat == {"count": len(chat_ids), "max_model_len": 256, "tokens": chat_ids}


def test_64_concurrent_streams(server):
    async def one(aclient, i):
        ids, max_tokens = prompt_ids(i, 5 + i % 20), 8 + i % 9
        stream = await aclient.completions.create(
            model=MODEL, prompt=ids, max_tokens=max_tokens, temperature=0, stream=True, extra_body={"ignore_eos": True}
        )
        finishes = [c.choices[0].finish_reason async for c in stream if c.choices]
        return finishes

    async def main():
        async with openai.AsyncOpenAI(base_url=f"{server.base_url}/v1", api_key="unused", max_retries=0) as aclient:
            return await asyncio.gather(*(one(aclient, i) for i in range(64)))

    results = asyncio.run(main())
    assert all(f[-1] == "length" and f.count("length") == 1 for f in results)


# --- errors --------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "body, param, text",
    [
        ({"prompt": "x", "tools": [{"type": "function"}]}, "tools", "unsupported"),
        ({"prompt": "x", "best_of": 3}, "best_of", "best_of"),
        ({"prompt": "x", "temperature": -1}, "temperature", "temperature"),
        ({"prompt": "x", "top_p": 0}, "top_p", "top_p"),
        ({"prompt": "x", "n": 0}, "n", "n"),
        ({"prompt": "x", "max_tokens": 0}, "max_tokens", "max_tokens"),
        ({"prompt": "x", "logprobs": 21}, "logprobs", "20"),
        ({"prompt": ""}, "prompt", "empty"),
        ({"prompt": [VOCAB_SIZE + 5]}, "prompt", "vocabulary"),
        ({"prompt": list(range(3, 300))}, "prompt", "297 tokens, but max_model_len is 256"),
        ({"prompt": "x", "stream_options": {"include_usage": True}}, "stream_options", "stream"),
        ({"prompt": "x", "stream": True, "stream_options": {"continuous_usage_stats": 1}}, "stream_options", "boolean"),
        ({"prompt": "x", "suffix": 0}, "suffix", "string"),
        ({"prompt": "x", "suffix": {}}, "suffix", "string"),
        ({"prompt": "x", "suffix": "tail"}, "suffix", "not supported"),
        ({}, "prompt", "prompt"),
    ],
)
def test_completion_validation_errors_are_400(server, body, param, text):
    assert_error(post(server, "/v1/completions", json={"model": MODEL} | body), 400, param, text)


@pytest.mark.parametrize(
    "body, param",
    [
        ({"messages": [{"role": "user", "content": "x"}], "response_format": {"type": "xml"}}, "response_format"),
        ({"messages": [{"role": "tool", "content": "x"}]}, "messages"),
        ({"messages": [{"role": "user", "content": [{"type": "image_url", "image_url": {}}]}]}, "messages"),
        ({"messages": [{"role": "user", "content": "x"}], "top_logprobs": 2}, "top_logprobs"),
        ({"messages": []}, "messages"),
    ],
)
def test_chat_validation_errors_are_400(server, body, param):
    assert_error(post(server, "/v1/chat/completions", json={"model": MODEL} | body), 400, param)


def test_other_errors(server):
    assert_error(post(server, "/v1/completions", json={"model": "gpt-4", "prompt": "x"}), 404, "model")
    assert_error(post(server, "/v1/nothing", json={}), 404)
    json_type = {"Content-Type": "application/json"}  # without it: 415 (test_server_hardening.py)
    assert_error(post(server, "/v1/completions", content=b"{not json", headers=json_type), 400, text="JSON")
    assert_error(post(server, "/v1/completions", content=b" " * (17 << 20), headers=json_type), 413)


def test_the_engine_keeps_serving_after_errors(server, client, tiny_llama_checkpoint):
    with pytest.raises(openai.BadRequestError):
        # The engine takes the first prompt, refuses the second, and withdraws the first.
        client.completions.create(model=MODEL, prompt=[[5, 6, 7], [VOCAB_SIZE + 1]], max_tokens=3)
    out = client.completions.create(
        model=MODEL, prompt=[5, 6, 7], max_tokens=3, temperature=0, extra_body={"ignore_eos": True}
    )
    expected = reference_greedy(tiny_llama_checkpoint[1], [5, 6, 7], 3)
    assert out.choices[0].finish_reason == "length" and out.usage.completion_tokens == 3
    assert out.choices[0].text == server.engine.info.tokenizer.decode(expected)


# --- cancellation --------------------------------------------------------------------------------


@dataclass
class HeldEngine:
    running: threading.Event  # a step has produced text: the request is known to be running
    abandoned: threading.Event  # the HTTP handler has aborted its call (the abort is queued for the engine)


def hold_the_engine_until_the_call_is_abandoned(server, monkeypatch) -> HeldEngine:
    """Once a step has produced text, the engine takes no further step until the handler has aborted the
    call: the request cannot run to its length however long the server takes to see the client leave."""
    engine, held = server.engine.engine, HeldEngine(threading.Event(), threading.Event())
    step, abort = engine.step, Submission.abort

    def held_step():
        if held.running.is_set():
            held.abandoned.wait(timeout=120)  # the test itself gives up after 60 s
        outputs = step()
        if any(c.delta for out in outputs for c in out.outputs):
            held.running.set()
        return outputs

    def abort_then_release(submission):
        abort(submission)  # queues the abort command, so the engine's next look at its queue sees it
        held.abandoned.set()

    monkeypatch.setattr(engine, "step", held_step)
    monkeypatch.setattr(Submission, "abort", abort_then_release)
    return held


def finishes(server) -> dict[str, float]:
    """Completions finished so far, by reason."""
    counts = {}
    for line in httpx.get(f"{server.base_url}/metrics").text.splitlines():
        if line.startswith("jserve:request_success_total{"):
            counts[line.split('finished_reason="')[1].split('"')[0]] = float(line.rsplit(" ", 1)[1])
    return counts


def assert_aborted_and_freed(server, before: dict[str, float], completions: int) -> None:
    """`completions` more completions finish, every one of them aborted, and the engine gives back its pages."""

    def since_before() -> dict[str, float]:
        return {reason: count - before[reason] for reason, count in finishes(server).items() if count != before[reason]}

    wait_until(lambda: sum(since_before().values()) >= completions, timeout=60)
    assert since_before() == {"abort": completions}
    wait_until(lambda: not server.engine.engine.has_unfinished_requests(), timeout=60)
    assert_engine_idle(server.engine)
    assert not server.engine.submissions


def test_disconnected_stream_is_aborted(server, monkeypatch):
    held = hold_the_engine_until_the_call_is_abandoned(server, monkeypatch)
    before = finishes(server)
    body = {"model": MODEL, "prompt": "long", "max_tokens": 200, "stream": True, "ignore_eos": True}
    with httpx.stream("POST", f"{server.base_url}/v1/completions", json=body, timeout=60) as response:
        assert response.status_code == 200
        first = next(line for line in response.iter_lines() if line.startswith("data: {"))
        assert json.loads(first.removeprefix("data: "))["choices"][0]["text"]
    # Leaving the block closed the connection with 199 tokens or more still to go.
    assert held.running.is_set()
    assert held.abandoned.wait(timeout=60), "the server never aborted the stream its client left"
    assert_aborted_and_freed(server, before, 1)


def test_disconnected_whole_request_is_aborted(server, monkeypatch):
    held = hold_the_engine_until_the_call_is_abandoned(server, monkeypatch)
    before = finishes(server)
    body = json.dumps({"model": MODEL, "prompt": "long", "max_tokens": 250, "n": 8, "ignore_eos": True}).encode()
    head = ["POST /v1/completions HTTP/1.1", "Host: test", "Content-Type: application/json",
            f"Content-Length: {len(body)}", "", ""]  # fmt: skip
    port = int(server.base_url.rsplit(":", 1)[1])
    # A raw socket: the response comes only when all 8 are done, so the client hangs up once they run.
    with socket.create_connection(("127.0.0.1", port), timeout=60) as connection:
        connection.sendall("\r\n".join(head).encode() + body)
        assert held.running.wait(timeout=60), "the request never produced text"
    assert held.abandoned.wait(timeout=60), "the server never aborted the request its client left"
    assert_aborted_and_freed(server, before, 8)


def test_metrics_names(server, client):
    counters = ("generation_tokens_total", "prompt_tokens_total", "engine_steps_total", "engine_host_seconds_total",
                "spec_decode_num_accepted_tokens_total")  # fmt: skip
    before = {name: server.metric(name) for name in counters}
    finished_before = finishes(server)
    out = client.completions.create(model=MODEL, prompt="metrics", max_tokens=3, extra_body={"ignore_eos": True})
    text = httpx.get(f"{server.base_url}/metrics").text
    for name in ("num_requests_running", "num_requests_waiting", "kv_cache_usage_perc", "prefix_cache_queries_total",
                 "prefix_cache_hits_total", "num_preemptions_total", "prompt_tokens_total", "generation_tokens_total",
                 "request_success_total", "time_to_first_token_seconds_bucket", "inter_token_latency_seconds_bucket",
                 "e2e_request_latency_seconds_bucket", "request_queue_time_seconds_bucket", "engine_steps_total",
                 "engine_host_seconds_total", "device_busy_seconds_total", "device_idle_seconds_total"):  # fmt: skip
        assert f"jserve:{name}" in text, name
    # The engine thread updates the metrics before it hands the outputs over: they count this request already.
    assert server.metric("generation_tokens_total") == before["generation_tokens_total"] + 3
    assert server.metric("prompt_tokens_total") == before["prompt_tokens_total"] + out.usage.prompt_tokens
    assert finishes(server) == finished_before | {"length": finished_before["length"] + 1}
    # A step per token at least, but for accepted drafts (each step gives one token more than it accepts).
    accepted = server.metric("spec_decode_num_accepted_tokens_total") - before["spec_decode_num_accepted_tokens_total"]
    assert server.metric("engine_steps_total") >= before["engine_steps_total"] + 3 - accepted
    assert server.metric("engine_host_seconds_total") > before["engine_host_seconds_total"]


# --- the default model ---------------------------------------------------------------------------


def test_smollm2_knows_the_capital_of_france(smollm2_gguf_path):
    args = EngineArgs(model=str(smollm2_gguf_path), dtype="float32", max_model_len=512, max_num_seqs=4,
                      max_num_batched_tokens=128, enable_prefix_caching=False)  # fmt: skip
    with running_server(args, ServerSettings("SmolLM2-135M-Instruct")) as handle:
        client = openai.OpenAI(base_url=f"{handle.base_url}/v1", api_key="unused")
        reply = client.chat.completions.create(
            model="SmolLM2-135M-Instruct",
            temperature=0,
            max_tokens=32,
            messages=[{"role": "user", "content": "What is the capital of France?"}],
        )
        # float32 greedy, as in test_smollm2.py, which checks it token for token against transformers
        assert reply.choices[0].message.content == "The capital of France is Paris."
        assert reply.choices[0].finish_reason == "stop"
