"""Scoring text over HTTP: completions with echo and logprobs (what lm-evaluation-harness sends), max_tokens 0,
and vLLM's prompt_logprobs field, checked against transformers' log_softmax."""

import httpx
import numpy as np
import pytest
from scipy.special import log_softmax

from server_utils import (
    MODEL,
    assert_error,
    assert_server_idle,
    prompt_ids,
)
from tiny_models import reference_logits


@pytest.fixture(scope="module")
def server(tiny_server):
    return tiny_server


@pytest.fixture(autouse=True)
def engine_idle_after(server):
    yield
    assert_server_idle(server)


def post(server, path: str, **body) -> httpx.Response:
    return httpx.post(f"{server.base_url}{path}", json={"model": MODEL, **body}, timeout=60)


def expected_logprobs(checkpoint, ids: list[int]) -> np.ndarray:
    rows = log_softmax(reference_logits(checkpoint[1], ids).astype(np.float64), axis=-1)
    return rows[np.arange(len(ids) - 1), ids[1:]]


def test_echo_with_logprobs_and_max_tokens_0_scores_the_prompt(server, tiny_llama_checkpoint):
    prompts = [prompt_ids(1, 30), prompt_ids(2, 17)]  # token-id prompts, as lm-eval sends them
    body = post(server, "/v1/completions", prompt=prompts, echo=True, logprobs=1, max_tokens=0).json()
    tokenizer = server.engine.info.tokenizer
    assert body["usage"]["completion_tokens"] == 0
    for ids, choice in zip(prompts, body["choices"], strict=True):
        assert choice["text"] == tokenizer.decode(ids) and choice["finish_reason"] == "length"
        logprobs = choice["logprobs"]
        assert set(logprobs) == {"tokens", "token_logprobs", "top_logprobs", "text_offset"}
        assert logprobs["tokens"] == [tokenizer.decode([t], skip_special_tokens=False) for t in ids]
        assert logprobs["token_logprobs"][0] is None and logprobs["top_logprobs"][0] is None
        np.testing.assert_allclose(logprobs["token_logprobs"][1:], expected_logprobs(tiny_llama_checkpoint, ids),
                                   atol=1e-4)  # fmt: skip
        assert all(1 <= len(top) <= 2 for top in logprobs["top_logprobs"][1:])
        offsets = np.cumsum([0] + [len(t) for t in logprobs["tokens"][:-1]]).tolist()
        assert logprobs["text_offset"] == offsets


def test_echo_with_logprobs_then_generation(server, tiny_llama_checkpoint):
    ids = prompt_ids(3, 12)
    body = post(server, "/v1/completions", prompt=ids, echo=True, logprobs=0, max_tokens=4, temperature=0,
                ignore_eos=True).json()  # fmt: skip
    choice = body["choices"][0]
    logprobs = choice["logprobs"]
    assert len(logprobs["tokens"]) == len(ids) + 4 and body["usage"]["completion_tokens"] == 4
    assert "".join(logprobs["tokens"][len(ids) :]) == choice["text"][len(server.engine.info.tokenizer.decode(ids)) :]
    np.testing.assert_allclose(logprobs["token_logprobs"][1 : len(ids)], expected_logprobs(tiny_llama_checkpoint, ids),
                               atol=1e-4)  # fmt: skip
    assert logprobs["text_offset"][len(ids)] == len(server.engine.info.tokenizer.decode(ids))


@pytest.mark.parametrize("special", ["<s>", "</s>"])
def test_echo_with_logprobs_keeps_the_prompts_special_tokens(server, special):
    """As vLLM echoes them: every prompt token, special ones too, in the text, the tokens and their offsets."""
    tokenizer = server.engine.info.tokenizer
    ids = tokenizer.encode(special * 3 + "the capital", add_special_tokens=False)  # ASCII: offsets add up
    text = tokenizer.decode(ids, skip_special_tokens=False)
    assert text.startswith(special * 3)
    for prompt in (ids, text):  # token ids, and a string that holds special tokens
        choice = post(server, "/v1/completions", prompt=prompt, echo=True, logprobs=1, max_tokens=3, temperature=0,
                      ignore_eos=True).json()["choices"][0]  # fmt: skip
        logprobs = choice["logprobs"]
        prompt_tokens = prompt if isinstance(prompt, list) else tokenizer.encode(prompt)
        assert choice["text"].startswith(text) and len(logprobs["tokens"]) == len(prompt_tokens) + 3
        expected = [tokenizer.decode([t], skip_special_tokens=False) for t in prompt_tokens]
        assert logprobs["tokens"][: len(prompt_tokens)] == expected
        assert logprobs["text_offset"][len(prompt_tokens)] == len(text)
        offsets = np.cumsum([0] + [len(t) for t in logprobs["tokens"][:-1]]).tolist()
        assert logprobs["text_offset"] == offsets


@pytest.mark.parametrize("path", ["/v1/completions", "/v1/chat/completions"])
def test_the_prompt_logprobs_field(server, path):
    """Where vLLM puts it: in each completion choice, beside a chat's choices; null when not asked for."""
    chat = path == "/v1/chat/completions"
    body = {"messages": [{"role": "user", "content": "hi"}]} if chat else {"prompt": prompt_ids(4, 9)}
    response = post(server, path, max_tokens=1, prompt_logprobs=2, **body).json()
    [choice] = response["choices"]
    entries = response["prompt_logprobs"] if chat else choice["prompt_logprobs"]
    assert ("prompt_logprobs" in choice) is not chat
    assert entries[0] is None and all(2 <= len(e) <= 3 for e in entries[1:])
    for entry in entries[1:]:
        for token_id, item in entry.items():
            assert int(token_id) >= 0 and set(item) == {"logprob", "rank", "decoded_token"}
    plain = post(server, path, max_tokens=1, **body).json()
    assert (plain if chat else plain["choices"][0])["prompt_logprobs"] is None


@pytest.mark.parametrize(
    "extra, param",
    [
        ({"max_tokens": 0}, "max_tokens"),
        ({"echo": True, "logprobs": 1, "stream": True}, "stream"),
        ({"prompt_logprobs": 21}, "prompt_logprobs"),
        ({"prompt_logprobs": -1}, "prompt_logprobs"),
        ({"prompt_logprobs": 1, "stream": True}, "prompt_logprobs"),  # as vLLM: a chunk has no place for them
    ],
)
def test_refused(server, extra, param):
    assert_error(post(server, "/v1/completions", prompt="hi", **extra), 400, param)
