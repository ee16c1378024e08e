"""Embedding models: LLM.embed against sentence-transformers on tiny checkpoints it saved itself (every pooling
mode, normalize on and off, Dense layers, both weight layouts, both pooling-config forms, inputs longer than a
chunk), batching, prompts, matryoshka truncation, the prefix cache, and bad input."""

from __future__ import annotations

import numpy as np
import pytest

from jserve import LLM, SamplingParams
from jserve.errors import RequestError
from jserve.pooling import parse_pooler_config

from server_utils import TINY_CHAT_TEMPLATE
from tiny_embedders import TEXTS, save_tiny_embedder
from tiny_models import assert_engine_idle, save_tiny_checkpoint, tiny_engine_args

pytest.importorskip("sentence_transformers", reason="install jserve's test extra: pip install -e '.[test]'")

# Small steps, so the longest text runs in several chunks.
ENGINE = dict(max_num_batched_tokens=32, max_num_seqs=8)
COSINE = 0.99999


def embedder(folder, **settings) -> LLM:
    args = tiny_engine_args(folder, **(ENGINE | {"max_model_len": 128, "enable_prefix_caching": True} | settings))
    return LLM.from_engine_args(args)


def vectors(outputs) -> np.ndarray:
    return np.array([o.outputs.embedding for o in outputs])


def assert_close(got: np.ndarray, want: np.ndarray) -> None:
    assert got.shape == want.shape
    cosine = (got * want).sum(1) / np.linalg.norm(got, axis=1) / np.linalg.norm(want, axis=1)
    assert cosine.min() >= COSINE, cosine
    np.testing.assert_allclose(got, want, rtol=1e-4, atol=1e-5)


CASES = {
    # Qwen3-Embedding's form: last token, normalized, the base model's weights
    "qwen3-last": dict(family="qwen3", modes="lasttoken"),
    "qwen3-last-dense-tanh": dict(family="qwen3", modes="lasttoken", dense="Tanh"),
    # the older pooling config, and the whole causal LM's weights (model. prefix, a head)
    "qwen2-mean-legacy-causal-lm": dict(
        family="qwen2", modes="mean", normalize=False, legacy_pooling_config=True, causal_lm_layout=True
    ),  # fmt: skip
    "mistral-cls": dict(family="mistral", modes="cls"),
    "mistral-max-dense": dict(family="mistral", modes="max", dense="Identity", normalize=False),
    "llama-weightedmean": dict(family="llama", modes="weightedmean"),
    "qwen3-mean-sqrt-and-last": dict(family="qwen3", modes=("mean_sqrt_len_tokens", "lasttoken"), normalize=False),
    # saved by sentence-transformers 6 with a chat template: texts go in as user messages through it
    "qwen3-last-chat-template": dict(
        family="qwen3",
        modes="lasttoken",
        chat_template=TINY_CHAT_TEMPLATE,
        prompts={"query": "Find the sentence"},
        default_prompt_name="query",
    ),  # fmt: skip
}


@pytest.mark.parametrize("case", list(CASES))
def test_vectors_match_sentence_transformers(tmp_path, case):
    reference = save_tiny_embedder(tmp_path / "model", **CASES[case])
    llm = embedder(tmp_path / "model")
    assert llm.embeds
    want = reference.encode(TEXTS, convert_to_numpy=True)
    outputs = llm.embed(TEXTS, use_tqdm=False)
    assert_close(vectors(outputs), want)
    prompt = reference.prompts.get(reference.default_prompt_name) if reference.default_prompt_name else None
    want_ids = [reference.preprocess([t], prompt=prompt)["input_ids"][0].tolist() for t in TEXTS]
    assert [o.prompt_token_ids for o in outputs] == want_ids
    assert len(outputs[-1].prompt_token_ids) > ENGINE["max_num_batched_tokens"]  # pooled across chunks
    assert_engine_idle(llm)


@pytest.fixture(scope="module")
def qwen3(tmp_path_factory):
    """A Qwen3 embedder with named prompts and matryoshka dimensions, and its engine."""
    folder = tmp_path_factory.mktemp("qwen3") / "model"
    prompts = {"query": "Instruct: find the sentence\nQuery: ", "document": ""}
    reference = save_tiny_embedder(folder, "qwen3", prompts=prompts, matryoshka=[16, 32, 64])
    return reference, embedder(folder)


def test_a_batch_equals_each_input_alone(qwen3):
    _, llm = qwen3
    rng = np.random.default_rng(0)
    inputs = [rng.integers(0, 200, int(rng.integers(1, 90))).tolist() for _ in range(64)]
    together = vectors(llm.embed(inputs, use_tqdm=False))
    alone = np.array([llm.embed([ids], use_tqdm=False)[0].outputs.embedding for ids in inputs[:12]])
    np.testing.assert_allclose(together[:12], alone, rtol=1e-5, atol=1e-6)
    assert_engine_idle(llm)


def test_token_ids_in_every_form(qwen3):
    _, llm = qwen3
    ids = llm.tokenizer.encode(TEXTS[0])
    forms = [ids, [ids], {"prompt_token_ids": ids}, [{"prompt_token_ids": ids}], TEXTS[0]]
    results = [vectors(llm.embed(form, use_tqdm=False)) for form in forms]
    for result in results:
        np.testing.assert_array_equal(result, results[0])


def test_prompts_and_matryoshka_dimensions(qwen3):
    reference, llm = qwen3
    want = reference.encode(TEXTS[:2], prompt_name="query", convert_to_numpy=True)
    assert_close(vectors(llm.embed(TEXTS[:2], prompt_name="query", use_tqdm=False)), want)
    cut = reference.encode(TEXTS[:2], truncate_dim=16, convert_to_numpy=True)
    cut = cut / np.linalg.norm(cut, axis=1, keepdims=True)
    assert_close(vectors(llm.embed(TEXTS[:2], dimensions=16, use_tqdm=False)), cut)
    with pytest.raises(RequestError, match=r"one of \[16, 32, 64\]"):
        llm.embed(TEXTS[0], dimensions=8)
    with pytest.raises(ValueError, match="not one of the model's prompts"):
        llm.embed(TEXTS[0], prompt_name="passage")
    assert_engine_idle(llm)


def test_score_is_the_cosine_of_the_vectors(qwen3):
    _, llm = qwen3
    a, b, c = vectors(llm.embed(TEXTS[:3], use_tqdm=False))
    scores = llm.score(TEXTS[0], TEXTS[1:3], use_tqdm=False)
    np.testing.assert_allclose(scores, [a @ b, a @ c], rtol=1e-5)  # (normalized vectors)
    with pytest.raises(ValueError, match="one against many"):
        llm.score(TEXTS[:2], TEXTS[:3])


def test_shared_prefixes_come_from_the_cache(qwen3):
    """Last-token pooling needs no state of the cached tokens: a long shared prefix is computed once, and the
    vectors are the same."""
    _, llm = qwen3
    prefix = TEXTS[3]
    first = llm.embed([prefix + " one"], use_tqdm=False)[0]
    second = llm.embed([prefix + " two", prefix + " one"], use_tqdm=False)
    assert first.num_cached_tokens == 0 and second[1].num_cached_tokens >= 32
    np.testing.assert_allclose(second[1].outputs.embedding, first.outputs.embedding, rtol=1e-5, atol=1e-6)


def test_bad_input_is_refused_and_changes_nothing(qwen3):
    _, llm = qwen3
    before = vectors(llm.embed(TEXTS[:2], use_tqdm=False))
    limit = llm.engine.config.max_model_len - 1
    with pytest.raises(RequestError, match="input has"):
        llm.embed([TEXTS[0], [5] * (limit + 1)])
    with pytest.raises(RequestError, match="empty"):
        llm.embed([[]])
    with pytest.raises(RequestError, match="outside the vocabulary"):
        llm.embed([[10**7]])
    with pytest.raises(ValueError, match="prompt_token_ids"):
        llm.embed({"ids": [1, 2]})
    with pytest.raises(ValueError, match="embedding model"):
        llm.generate("hello", SamplingParams(max_tokens=2))
    assert_engine_idle(llm)
    np.testing.assert_array_equal(vectors(llm.embed(TEXTS[:2], use_tqdm=False)), before)


def test_pooling_that_reads_every_token_turns_the_prefix_cache_off(tmp_path):
    save_tiny_embedder(tmp_path / "model", "qwen2", modes="mean")
    llm = embedder(tmp_path / "model")
    assert not llm.engine.config.enable_prefix_caching


def test_a_causal_lm_embeds_with_task_embed(tmp_path, qwen3):
    """A plain checkpoint, served with task embed and a pooler config, pools as sentence-transformers does
    with the same pooling over that checkpoint; as a generation model it refuses to embed."""
    from sentence_transformers import SentenceTransformer
    from sentence_transformers.sentence_transformer import modules as models

    folder = tmp_path / "llama"
    save_tiny_checkpoint(folder, "llama")
    transformer = models.Transformer(str(folder))
    transformer.tokenizer.pad_token = transformer.tokenizer.eos_token
    mean = SentenceTransformer(modules=[transformer, models.Pooling(transformer.get_embedding_dimension(), "mean")])
    llm = embedder(folder, task="embed", pooler_config='{"pooling_type": "MEAN", "normalize": false}')
    assert_close(vectors(llm.embed(TEXTS, use_tqdm=False)), mean.encode(TEXTS, convert_to_numpy=True))
    generator = LLM.from_engine_args(tiny_engine_args(folder))
    with pytest.raises(ValueError, match="generates text"):
        generator.embed(TEXTS[0])
    with pytest.raises(ValueError, match="--task embed"):
        LLM.from_engine_args(tiny_engine_args(folder, pooler_config={"pooling_type": "LAST"}))


@pytest.mark.parametrize(
    "value, message",
    [
        ("{not json", "not valid JSON"),
        ('["MEAN"]', "JSON object"),
        ({"pooling_type": "MEDIAN"}, "MEDIAN"),
        ({"normalize": "yes"}, "true or false"),
        ({"dimensions": 8}, "unknown keys"),
    ],
)
def test_bad_pooler_configs_say_what_is_wrong(value, message):
    with pytest.raises(ValueError, match=message):
        parse_pooler_config(value)


def test_pooler_config_names_map_to_sentence_transformers_modes():
    assert parse_pooler_config('{"pooling_type": "LAST", "normalize": false}') == {
        "pooling_type": "lasttoken",
        "normalize": False,
    }
    assert parse_pooler_config({"pooling_type": "weightedmean"}) == {"pooling_type": "weightedmean"}
