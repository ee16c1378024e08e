"""A server started as `jserve serve --speculative-config '{"method": "ngram", ...}'` on the default model
(SmolLM2-135M): its replies to prompts whose answers quote them equal a plain server's token for token
(greedy and seeded, streamed and whole, with logprobs), its drafts are accepted, and /metrics carries
vLLM's speculative decoding counters."""

import json

import openai
import pytest

from jserve.cli import build_parser
from jserve.engine.args import EngineArgs
from jserve.server import ServerSettings

from server_utils import assert_server_idle, running_server

MODEL = "smollm2"
NGRAM = {"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_max": 4, "prompt_lookup_min": 2}
CODE = """def total_price(items, tax_rate):
    subtotal = 0
    for item in items:
        subtotal += item["price"] * item["quantity"]
    return subtotal * (1 + tax_rate)
"""
QUOTING = [
    f"Add a docstring to this function and return the whole function:\n\n{CODE}",
    "Fix the spelling in this text and return it unchanged otherwise:\n\nThe quick brown fox jumsp over the "
    "lazy dog. The dog was not amused, and it barkd loudly at the fox.",
    f"Rename `subtotal` to `total` in this function:\n\n{CODE}",
]
FLAGS = ["--max-model-len", "1024", "--max-num-seqs", "8", "--kv-cache-memory", str(256 << 20)]


def engine_args(path, *flags) -> EngineArgs:
    """EngineArgs as `jserve serve` reads them from its command line."""
    return EngineArgs.from_cli_args(build_parser().parse_args(["serve", str(path), *FLAGS, *flags]))


@pytest.fixture(scope="module")
def servers(smollm2_gguf_path):
    spec_args = engine_args(smollm2_gguf_path, "--speculative-config", json.dumps(NGRAM))
    assert spec_args.speculative_config == json.dumps(NGRAM)
    with (
        running_server(engine_args(smollm2_gguf_path), ServerSettings(MODEL)) as plain,
        running_server(spec_args, ServerSettings(MODEL)) as spec,
    ):
        yield plain, spec


@pytest.fixture(autouse=True)
def engines_idle_after(servers):
    yield
    for handle in servers:
        assert_server_idle(handle)


def clients(servers):
    return [openai.OpenAI(base_url=f"{s.base_url}/v1", api_key="unused", max_retries=0) for s in servers]


def test_greedy_chat_replies_equal_a_plain_servers_and_drafts_are_accepted(servers):
    plain, spec = clients(servers)
    accepted_before = servers[1].metric("spec_decode_num_accepted_tokens_total")
    for prompt in QUOTING:
        kwargs = dict(model=MODEL, messages=[{"role": "user", "content": prompt}], max_tokens=96, temperature=0)
        want, got = plain.chat.completions.create(**kwargs), spec.chat.completions.create(**kwargs)
        assert got.choices[0].message.content == want.choices[0].message.content
        assert got.choices[0].finish_reason == want.choices[0].finish_reason
        assert got.usage.completion_tokens == want.usage.completion_tokens
    handle = servers[1]
    drafts = handle.metric("spec_decode_num_drafts_total")
    proposed = handle.metric("spec_decode_num_draft_tokens_total")
    accepted = handle.metric("spec_decode_num_accepted_tokens_total")
    assert accepted - accepted_before > 20 and 0 < drafts and accepted <= proposed
    assert handle.metric("spec_decode_num_accepted_tokens_per_pos_total") == accepted
    assert handle.engine.engine.stats.spec_accepted_per_pos[0] > 0


def test_completions_with_logprobs_seeded_n_and_streaming(servers):
    plain, spec = clients(servers)
    kwargs = dict(model=MODEL, prompt=QUOTING[0], max_tokens=64, temperature=0, logprobs=2)
    want, got = plain.completions.create(**kwargs), spec.completions.create(**kwargs)
    assert got.choices[0].logprobs.tokens == want.choices[0].logprobs.tokens
    assert got.choices[0].logprobs.token_logprobs == pytest.approx(want.choices[0].logprobs.token_logprobs, abs=1e-3)
    seeded = dict(model=MODEL, prompt=QUOTING[2], max_tokens=48, temperature=0.8, seed=7, n=2)
    assert [c.text for c in spec.completions.create(**seeded).choices] == [
        c.text for c in plain.completions.create(**seeded).choices
    ]
    messages = [{"role": "user", "content": QUOTING[1]}]
    streamed = spec.chat.completions.create(model=MODEL, messages=messages, max_tokens=64, temperature=0, stream=True)
    text = "".join(chunk.choices[0].delta.content or "" for chunk in streamed if chunk.choices)
    whole = plain.chat.completions.create(model=MODEL, messages=messages, max_tokens=64, temperature=0)
    assert text == whole.choices[0].message.content
