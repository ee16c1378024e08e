"""`jserve serve <embedder>`: /v1/embeddings through the official `openai` client and httpx, /v1/score, what
/v1/models says, bad input, metrics, and the answers of a server whose model generates."""

from __future__ import annotations

import base64

import httpx
import numpy as np
import openai
import pytest

from jserve.server import ServerSettings

from server_utils import MODEL, assert_error, assert_server_idle, running_server
from tiny_embedders import TEXTS, save_tiny_embedder
from tiny_models import tiny_engine_args

pytest.importorskip("sentence_transformers", reason="install jserve's test extra: pip install -e '.[test]'")


@pytest.fixture(scope="module")
def embedder(tmp_path_factory):
    """(the sentence-transformers reference, a server on the same checkpoint)."""
    folder = tmp_path_factory.mktemp("qwen3") / "model"
    reference = save_tiny_embedder(folder, "qwen3", matryoshka=[16, 32, 64])
    args = tiny_engine_args(folder, max_model_len=128, max_num_batched_tokens=32, enable_prefix_caching=True)
    with running_server(args, ServerSettings(MODEL)) as handle:
        yield reference, handle


def post(handle, path: str, body: dict) -> httpx.Response:
    return httpx.post(f"{handle.base_url}{path}", json=body, timeout=60)


def cosines(got: np.ndarray, want: np.ndarray) -> np.ndarray:
    return (got * want).sum(1) / np.linalg.norm(got, axis=1) / np.linalg.norm(want, axis=1)


def test_the_openai_client_gets_the_reference_vectors(embedder):
    reference, handle = embedder
    client = openai.OpenAI(base_url=f"{handle.base_url}/v1", api_key="unused", max_retries=0)
    response = client.embeddings.create(model=MODEL, input=TEXTS)  # (the client asks for base64)
    got = np.array([d.embedding for d in response.data])
    assert cosines(got, reference.encode(TEXTS, convert_to_numpy=True)).min() >= 0.99999
    tokens = [reference.tokenize([t])["input_ids"][0].tolist() for t in TEXTS]
    assert response.usage.prompt_tokens == response.usage.total_tokens == sum(map(len, tokens))
    cut = client.embeddings.create(model=MODEL, input=TEXTS[0], dimensions=16).data[0].embedding
    assert len(cut) == 16 and abs(np.linalg.norm(cut) - 1) < 1e-5
    assert_server_idle(handle)


def test_every_input_form_and_encoding(embedder):
    reference, handle = embedder
    ids = reference.tokenize([TEXTS[0]])["input_ids"][0].tolist()
    floats = post(handle, "/v1/embeddings", {"input": TEXTS[0], "encoding_format": "float"}).json()
    want = np.array(floats["data"][0]["embedding"])
    assert floats["object"] == "list" and floats["data"][0]["object"] == "embedding" and floats["model"] == MODEL
    for form in (ids, [ids], [TEXTS[0]]):
        data = post(handle, "/v1/embeddings", {"model": MODEL, "input": form}).json()["data"]
        np.testing.assert_allclose(data[0]["embedding"], want, rtol=1e-6, atol=1e-7)
    packed = post(handle, "/v1/embeddings", {"input": [ids, ids], "encoding_format": "base64"}).json()
    for item in packed["data"]:
        vector = np.frombuffer(base64.b64decode(item["embedding"]), "<f4")
        np.testing.assert_allclose(vector, want, rtol=1e-6, atol=1e-7)
    assert [item["index"] for item in packed["data"]] == [0, 1]


def test_score_is_the_cosine_of_the_reference_vectors(embedder):
    reference, handle = embedder
    response = post(handle, "/v1/score", {"model": MODEL, "text_1": TEXTS[0], "text_2": TEXTS[1:]}).json()
    vectors = reference.encode(TEXTS, convert_to_numpy=True)
    want = [float(vectors[0] @ v) for v in vectors[1:]]  # (normalized vectors)
    assert [d["index"] for d in response["data"]] == [0, 1, 2]
    np.testing.assert_allclose([d["score"] for d in response["data"]], want, atol=1e-5)
    pairwise = post(handle, "/v1/score", {"text_1": TEXTS[:2], "text_2": TEXTS[2:]}).json()["data"]
    np.testing.assert_allclose([d["score"] for d in pairwise], [vectors[0] @ vectors[2], vectors[1] @ vectors[3]],
                               atol=1e-5)  # fmt: skip


def test_bad_input_gets_a_400_naming_the_field(embedder):
    _, handle = embedder
    assert_error(post(handle, "/v1/embeddings", {"input": ""}), 400, "input", "empty")
    assert_error(post(handle, "/v1/embeddings", {"input": []}), 400, "input")
    assert_error(post(handle, "/v1/embeddings", {"input": ["a", [1, 2]]}), 400, "input")
    assert_error(post(handle, "/v1/embeddings", {"input": [[5] * 200]}), 400, "input", "200 tokens")
    assert_error(post(handle, "/v1/embeddings", {"input": [[10**7]]}), 400, "input", "vocabulary")
    assert_error(post(handle, "/v1/embeddings", {"input": "a", "dimensions": 8}), 400, "dimensions", "[16, 32, 64]")
    assert_error(post(handle, "/v1/embeddings", {"input": "a", "dimensions": 0}), 400, "dimensions")
    assert_error(post(handle, "/v1/embeddings", {"input": "a", "encoding_format": "int8"}), 400, "encoding_format")
    assert_error(post(handle, "/v1/embeddings", {"input": "a", "model": "other"}), 404, "model")
    assert_error(post(handle, "/v1/score", {"text_1": TEXTS[:2], "text_2": TEXTS[:3]}), 400, "text_2")
    assert_error(post(handle, "/v1/completions", {"prompt": "hi", "max_tokens": 2}), 400, "model", "/v1/embeddings")
    assert_server_idle(handle)


def test_models_says_what_it_does_and_metrics_count_inputs(embedder):
    _, handle = embedder
    card = httpx.get(f"{handle.base_url}/v1/models").json()["data"][0]
    assert card["task"] == "embed" and card["embedding_dimension"] == 64
    before = {name: handle.metric(name) for name in ("prompt_tokens_total", "request_success_total")}
    fresh = ["a text no earlier test sent", "nor this one"]  # (computed in full: nothing cached)
    usage = post(handle, "/v1/embeddings", {"input": fresh}).json()["usage"]
    assert handle.metric("prompt_tokens_total") == before["prompt_tokens_total"] + usage["prompt_tokens"]
    assert handle.metric("request_success_total") == before["request_success_total"] + 2


def test_a_generation_server_says_how_to_serve_an_embedder(tiny_server):
    assert_error(post(tiny_server, "/v1/embeddings", {"input": "hi"}), 400, "model", "--task embed")
    assert_error(post(tiny_server, "/v1/score", {"text_1": "a", "text_2": "b"}), 400, "model", "--task embed")
    assert httpx.get(f"{tiny_server.base_url}/v1/models").json()["data"][0]["task"] == "generate"
