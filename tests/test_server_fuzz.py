"""Two thousand hostile request bodies against a running server: every answer is a 200 or a 4xx, none is a
5xx or a hang, and afterwards the server answers a fixed greedy request exactly as before."""

import collections
import json

import httpx
import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from jserve.engine.args import EngineArgs
from jserve.server import ServerSettings

from server_utils import MODEL, TINY_CHAT_TEMPLATE, running_server, wait_until
from tiny_models import VOCAB_SIZE, assert_engine_idle, tiny_kv_bytes

BODIES = 2000
REQUEST_TIMEOUT_S = 30  # a hang fails the test at once instead of eating the suite's budget

LONE_SURROGATES = st.sampled_from(["\udfff", "\ud800", "\udc80"])
TEXT = st.one_of(
    st.text(max_size=20),
    st.builds(lambda a, s, b: a + s + b, st.text(max_size=4), LONE_SURROGATES, st.text(max_size=4)),
    st.sampled_from(["x" * 100_000, "", " ", "\x00", "<s>", "{{ 7*7 }}", "🦙" * 50]),
)
NUMBER = st.one_of(
    st.integers(-(2**80), 2**80),
    st.sampled_from([0, -1, 1, 2, 2**31, 2**32, 2**63 - 1, 2**63, -(2**63) - 1, 16385, 10**30]),
    st.floats(allow_nan=True, allow_infinity=True),
)
SCALAR = st.one_of(st.none(), st.booleans(), NUMBER, TEXT)
CONTAINER = st.one_of(st.lists(SCALAR, max_size=3), st.dictionaries(TEXT, SCALAR, max_size=3))
NESTED = st.recursive(
    SCALAR,
    lambda inner: st.one_of(st.lists(inner, max_size=4), st.dictionaries(TEXT, inner, max_size=4)),
    max_leaves=12,
)
HOSTILE = st.one_of(SCALAR, CONTAINER, NESTED)
TOKEN_IDS = st.lists(st.integers(-5, VOCAB_SIZE + 5), min_size=0, max_size=12)

# Values a real client might send, so that a good share of bodies pass validation and generate.
PLAUSIBLE = {
    "model": st.sampled_from([MODEL, "gpt-4", "", "tiny\udfff"]),
    "prompt": st.one_of(TEXT, TOKEN_IDS, st.lists(TEXT, max_size=3), st.lists(TOKEN_IDS, max_size=3)),
    "max_tokens": st.integers(-2, 70),
    "max_completion_tokens": st.integers(-2, 70),
    "temperature": st.floats(-1, 3),
    "top_p": st.floats(-0.5, 1.5),
    "top_k": st.integers(-3, VOCAB_SIZE + 3),
    "min_p": st.floats(-0.5, 1.5),
    "n": st.integers(-1, 6),
    "seed": st.integers(-(2**64), 2**64),
    "stop": st.one_of(TEXT, st.lists(TEXT, max_size=40)),
    "stop_token_ids": TOKEN_IDS,
    "logit_bias": st.dictionaries(st.one_of(TEXT, st.integers(-3, 400).map(str)), NUMBER, max_size=5),
    "logprobs": st.one_of(st.booleans(), st.integers(-1, 25)),
    "top_logprobs": st.integers(-1, 25),
    "echo": st.booleans(),
    "stream": st.booleans(),
    "stream_options": st.one_of(st.just({"include_usage": True}), HOSTILE),
    "ignore_eos": st.booleans(),
    "min_tokens": st.integers(-1, 80),
    "presence_penalty": st.floats(-3, 3),
    "frequency_penalty": st.floats(-3, 3),
    "repetition_penalty": st.floats(-1, 3),
    "priority": st.integers(-2, 2),
    "cache_salt": TEXT,
    "user": TEXT,
    "best_of": st.integers(-1, 3),
    "suffix": TEXT,
    "skip_special_tokens": st.booleans(),
    "response_format": st.one_of(st.just({"type": "text"}), st.just({"type": "json_object"}), HOSTILE),
    "add_generation_prompt": st.booleans(),
    "messages": st.lists(HOSTILE, max_size=3),
    "unknown_field": HOSTILE,
}
FIELDS = sorted(PLAUSIBLE)


def sometimes_hostile(plausible):
    """The plausible strategy, or one time in four anything at all."""
    return st.integers(0, 3).flatmap(lambda i: HOSTILE if i == 0 else plausible)


ROLES = ["system", "developer", "user", "assistant"]
CLIENT_MESSAGES = st.lists(
    st.fixed_dictionaries({"role": st.sampled_from(ROLES), "content": TEXT}, optional={"name": TEXT}),
    min_size=1,
    max_size=3,
)
ODD_MESSAGES = st.lists(
    st.fixed_dictionaries(
        {"role": sometimes_hostile(st.sampled_from([*ROLES, "tool", "wizard"])),
         "content": sometimes_hostile(st.one_of(TEXT, st.lists(st.fixed_dictionaries({"type": st.just("text"),
                                                                                      "text": TEXT}), max_size=3)))},
        optional={"name": sometimes_hostile(TEXT), "tool_calls": HOSTILE},
    ),
    min_size=1,
    max_size=4,
)  # fmt: skip
MESSAGES = st.integers(0, 1).flatmap(lambda i: ODD_MESSAGES if i == 0 else CLIENT_MESSAGES)


@st.composite
def json_bodies(draw):
    """A valid request with up to four fields replaced by values a client might send or, one time in four,
    by anything at all."""
    path = draw(st.sampled_from(["/v1/completions", "/v1/chat/completions", "/tokenize"]))
    body = {"model": MODEL, "max_tokens": 4}
    chat = path == "/v1/chat/completions" or path == "/tokenize" and draw(st.booleans())
    body |= {"messages": draw(MESSAGES)} if chat else {"prompt": "hi"}
    for field in draw(st.lists(st.sampled_from(FIELDS), max_size=4, unique=True)):
        body[field] = draw(sometimes_hostile(PLAUSIBLE[field]))
    return path, json.dumps(body).encode()  # ASCII escapes carry lone surrogates as \udfff


RAW_BODIES = st.tuples(
    st.sampled_from(["/v1/completions", "/v1/chat/completions", "/tokenize", "/detokenize"]),
    st.one_of(
        st.binary(max_size=64),
        st.integers(1, 200_000).map(lambda depth: b'{"prompt": ' + b"[" * depth + b"]" * depth + b"}"),
        st.just('{"prompt": "a\udfffb"}'.encode("utf-8", "surrogatepass")),  # a lone surrogate's UTF-8 bytes
        st.sampled_from([b"[]", b"null", b"1", b'"x"', b"{", b'{"prompt": NaN}', b'{"a": 1, "a": 2}']),
    ),
)


@pytest.fixture(scope="module")
def server(tiny_llama_checkpoint):
    args = EngineArgs(model=str(tiny_llama_checkpoint[0]), dtype="float32", max_model_len=64, max_num_seqs=4,
                      max_num_batched_tokens=64, kv_cache_memory=tiny_kv_bytes(32))  # fmt: skip
    with running_server(args, ServerSettings(MODEL, max_queue=16, chat_template=TINY_CHAT_TEMPLATE)) as handle:
        yield handle


def greedy(server, client: httpx.Client) -> dict:
    prompt = np.random.default_rng(5).integers(3, VOCAB_SIZE, 10).tolist()
    body = {"model": MODEL, "prompt": prompt, "max_tokens": 20, "temperature": 0, "ignore_eos": True, "logprobs": 2}
    response = client.post("/v1/completions", json=body)
    assert response.status_code == 200, response.text
    return response.json()["choices"][0]


def test_hostile_bodies_never_get_a_5xx_or_hang(server):
    statuses: collections.Counter[int] = collections.Counter()
    with httpx.Client(base_url=server.base_url, timeout=REQUEST_TIMEOUT_S) as client:  # one keep-alive pool
        before = greedy(server, client)

        @settings(
            max_examples=BODIES, deadline=None, derandomize=True, database=None, suppress_health_check=list(HealthCheck)
        )
        @given(st.integers(0, 4).flatmap(lambda kind: RAW_BODIES if kind == 0 else json_bodies()))
        def answer(request):
            path, content = request
            response = client.post(path, content=content, headers={"Content-Type": "application/json"})
            statuses[response.status_code] += 1
            assert response.status_code == 200 or 400 <= response.status_code < 500, (request, response.text[:500])
            if response.status_code != 200:
                assert set(response.json()["error"]) == {"message", "type", "param", "code"}
            assert '"server_error"' not in response.text, (request, response.text[:500])  # streamed errors too

        answer()
        after = greedy(server, client)
    print(f"statuses of {sum(statuses.values())} hostile bodies: {dict(sorted(statuses.items()))}")
    assert sum(statuses.values()) >= BODIES
    assert statuses[200] > BODIES // 20 and statuses[400] > BODIES // 4  # both paths were explored
    assert after == before
    wait_until(lambda: not server.engine.engine.has_unfinished_requests())
    assert_engine_idle(server.engine)
    assert not server.engine.submissions
