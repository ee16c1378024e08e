"""Draft-model speculation on tiny checkpoints: whatever the draft proposes, the output is the one decoding
without speculation gives, greedy or seeded, for every family, in batches, with stops, logprobs, n > 1,
grammars, prefix caching, chunked prefill and preemption.

The draft is mostly a noisy copy of the target (its weights perturbed), so its proposals are often but not
always accepted; a draft that is the target itself must have every proposal accepted, greedy or sampled,
since it draws each token with the key the target draws it with."""

import copy
from types import SimpleNamespace

import numpy as np
import pytest
import torch

from jserve import LLM, SamplingParams, StructuredOutputsParams
from jserve.engine.stats import EngineStats
from jserve.spec_decode import SpeculativeConfig, Speculator, check_draft_model

from test_engine import prompts, tiny_llm, token_ids
from test_speculative import GREEDY, every_draft_verified, spec_counts
from tiny_models import (
    VARIANTS,
    VOCAB_SIZE,
    assert_engine_idle,
    reference_greedy,
    release_compiled,
    save_tiny_checkpoint,
    tiny_kv_bytes,
    tiny_tokenizer,
)

SEEDED = [SamplingParams(temperature=t, top_p=p, top_k=k, max_tokens=30, seed=s, ignore_eos=True)
          for t, p, k, s in [(1.0, 1.0, 0, 1), (0.7, 0.9, 0, 2), (1.3, 1.0, 5, 3), (0.5, 0.8, 20, 4),
                             (1.0, 1.0, 0, 5), (0.0, 1.0, 0, 6)]]  # fmt: skip


def draft_config(folder, **extra) -> dict:
    return {"model": str(folder), "num_speculative_tokens": 4, "disable_by_batch_size": 8} | extra


def save_noisy_copy(folder, model, noise: float) -> None:
    """The model with every weight perturbed by noise x its tensor's std: a draft that often agrees (random
    tiny models' distributions are flat, so a 1 % perturbation already flips about a third of the argmaxes)."""
    noisy = copy.deepcopy(model)
    generator = torch.Generator().manual_seed(1)
    with torch.no_grad():
        for weight in noisy.parameters():
            if weight.ndim > 1:
                weight += noise * weight.std() * torch.randn(weight.shape, generator=generator)
    noisy.save_pretrained(folder)
    tiny_tokenizer().save_pretrained(folder)


@pytest.fixture(scope="module")
def noisy_draft(tiny_llama_checkpoint, tmp_path_factory):
    folder = tmp_path_factory.mktemp("noisy-draft")
    save_noisy_copy(folder, tiny_llama_checkpoint[1], noise=0.01)
    return folder


@pytest.fixture(scope="module")
def spec(tiny_llama_checkpoint, noisy_draft):
    engine = tiny_llm(tiny_llama_checkpoint[0], speculative_config=draft_config(noisy_draft))
    yield engine
    assert_engine_idle(engine)


@pytest.fixture(autouse=True)
def drafts_kept(monkeypatch):
    every_draft_verified(monkeypatch)
    yield
    release_compiled()  # most tests here build engines of two models: their executables go with them


def counted(llm, run):
    """run(), and the draft tokens it verified and accepted."""
    before = spec_counts(llm)
    result = run()
    drafted, accepted = (a - b for a, b in zip(spec_counts(llm), before, strict=True))
    return result, drafted, accepted


def test_greedy_and_seeded_outputs_are_decoding_without_speculation(plain, spec):
    batch = prompts(6, seed=1)
    greedy = token_ids(plain.generate(batch, GREEDY, use_tqdm=False))
    for params in (GREEDY, SEEDED):
        want = token_ids(plain.generate(batch, params, use_tqdm=False))
        got, drafted, accepted = counted(spec, lambda p=params: token_ids(spec.generate(batch, p, use_tqdm=False)))
        assert got == want
        assert 0 < accepted < drafted  # the noisy draft is right often, not always
    for i in (0, 3):
        assert token_ids(spec.generate([batch[i]], GREEDY, use_tqdm=False))[0] == greedy[i]
    mixed = [SamplingParams(temperature=0, max_tokens=int(n), ignore_eos=True) for n in (5, 40, 17, 40, 2, 33)]
    cut = [ids[: p.max_tokens] for ids, p in zip(greedy, mixed, strict=True)]
    assert token_ids(spec.generate(batch, mixed, use_tqdm=False)) == cut


def test_the_target_as_its_own_draft_has_every_proposal_accepted(tiny_llama_checkpoint, plain):
    """The draft samples each position with the target's key for it: the same model draws the same token,
    sampled as well as greedy."""
    folder = tiny_llama_checkpoint[0]
    itself = tiny_llm(folder, speculative_config=draft_config(folder))
    batch = prompts(6, seed=2)
    for params in (GREEDY, SEEDED):
        want = token_ids(plain.generate(batch, params, use_tqdm=False))
        got, drafted, accepted = counted(itself, lambda p=params: token_ids(itself.generate(batch, p, use_tqdm=False)))
        assert got == want
        assert accepted == drafted > 0
    assert_engine_idle(itself)


@pytest.mark.parametrize("variant", sorted(VARIANTS))
def test_every_family(tmp_path, variant):
    family, overrides = VARIANTS[variant]
    model = save_tiny_checkpoint(tmp_path / "target", family, **overrides)
    save_noisy_copy(tmp_path / "draft", model, noise=0.01)
    batch = prompts(4, seed=3)
    want = [reference_greedy(model, p, GREEDY.max_tokens) for p in batch]  # (transformers': no second engine)
    speculative = tiny_llm(tmp_path / "target", speculative_config=draft_config(tmp_path / "draft"))
    assert token_ids(speculative.generate(batch, GREEDY, use_tqdm=False)) == want
    assert spec_counts(speculative)[1] > 0
    assert_engine_idle(speculative)


def test_stops_logprobs_n_and_grammars(plain, spec):
    batch = prompts(4, seed=4)
    free = token_ids(plain.generate(batch, GREEDY, use_tqdm=False))
    text = plain.get_tokenizer().decode(free[1])
    schema = {"type": "object", "properties": {"a": {"type": "integer"}, "b": {"type": "string", "maxLength": 6}},
              "required": ["a", "b"], "additionalProperties": False}  # fmt: skip
    cases = [
        SamplingParams(temperature=0, max_tokens=40, stop_token_ids=[free[0][9]], logprobs=3),
        SamplingParams(temperature=0, max_tokens=40, stop=[text[10:14]]),
        SamplingParams(temperature=0.8, max_tokens=30, seed=7, n=3, ignore_eos=True),
        SamplingParams(temperature=0, max_tokens=60, structured_outputs=StructuredOutputsParams(json=schema)),
    ]
    want, got = (llm.generate(batch, cases, use_tqdm=False) for llm in (plain, spec))
    for w, g in zip(want, got, strict=True):
        for wc, gc in zip(w.outputs, g.outputs, strict=True):
            assert (gc.token_ids, gc.text, gc.finish_reason) == (wc.token_ids, wc.text, wc.finish_reason)
            assert gc.stop_reason == wc.stop_reason
    for w_entry, g_entry in zip(want[0].outputs[0].logprobs, got[0].outputs[0].logprobs, strict=True):
        assert list(g_entry) == list(w_entry)
        np.testing.assert_allclose([lp.logprob for lp in g_entry.values()],
                                   [lp.logprob for lp in w_entry.values()], atol=1e-4)  # fmt: skip


def test_prefix_cache_chunked_prefill_and_preemption(tiny_llama_checkpoint, noisy_draft, plain):
    """The draft's K/V follow the target's pages: shared from the cache, computed in chunks, recomputed after
    preemption."""
    batch = prompts(8, seed=8, low=30, high=70)
    params = SamplingParams(temperature=0, max_tokens=50, ignore_eos=True)
    expected = token_ids(plain.generate(batch, params, use_tqdm=False))
    folder, spec = tiny_llama_checkpoint[0], draft_config(noisy_draft)
    pages = 2 * tiny_kv_bytes(64)  # the plain engine's 64 pages, with the draft's K/V beside the target's
    # Prompts of 30-70 tokens in 32-token steps: the first round prefills them in chunks, the second reads
    # their pages from the cache and prefills the rest.
    cached = tiny_llm(folder, speculative_config=spec, enable_prefix_caching=True, max_num_batched_tokens=32,
                      kv_cache_memory=pages)  # fmt: skip
    for _ in range(2):
        assert token_ids(cached.generate(batch, params, use_tqdm=False)) == expected
    assert cached.engine.stats.prefix_cache_hits > 0
    assert_engine_idle(cached)
    cramped = tiny_llm(folder, speculative_config=spec, kv_cache_memory=2 * tiny_kv_bytes(24))  # target + draft
    assert cramped.engine.config.num_pages == 24
    outputs = cramped.generate(batch, params, use_tqdm=False)
    assert sum(o.metrics.num_preemptions for o in outputs) > 0
    assert token_ids(outputs) == expected
    assert spec_counts(cramped)[1] > 0
    assert_engine_idle(cramped)


def test_a_draft_with_a_smaller_vocabulary(tmp_path, tiny_llama_checkpoint):
    """A target whose embedding is padded past the tokenizer (as many are) takes a draft whose is not: the
    draft's logits are padded to the target's vocabulary."""
    padded = tmp_path / "padded"
    save_tiny_checkpoint(padded, "llama", vocab_size=VOCAB_SIZE + 64)
    batch = prompts(4, seed=5)
    want = token_ids(tiny_llm(padded).generate(batch, SEEDED[:4], use_tqdm=False))
    speculative = tiny_llm(padded, speculative_config=draft_config(tiny_llama_checkpoint[0]))
    assert token_ids(speculative.generate(batch, SEEDED[:4], use_tqdm=False)) == want
    assert spec_counts(speculative)[0] > 0
    assert_engine_idle(speculative)


@pytest.mark.parametrize(
    "config, message",
    [
        ({"method": "draft_model", "num_speculative_tokens": 4}, "needs a 'model'"),
        ({"method": "ngram", "model": "/some/draft"}, "'model' is for method 'draft_model'"),
        ({"model": "/some/draft", "prompt_lookup_max": 3}, "'prompt_lookup_max' is for method 'ngram'"),
        ({"model": "/some/draft", "quantization": "fp4"}, "quantization must be one of"),
    ],
)
def test_bad_configs_are_refused(config, message):
    with pytest.raises(ValueError, match=message):
        SpeculativeConfig.parse(config)


def test_a_model_means_draft_model_speculation():
    config = SpeculativeConfig.parse('{"model": "/some/draft", "num_speculative_tokens": 3}')
    assert config.uses_draft_model and config.method == "draft_model" and config.num_speculative_tokens == 3


def test_a_draft_must_share_the_targets_tokenizer():
    def loaded(pieces):
        tokenizer = SimpleNamespace(vocab_size=len(pieces), convert_ids_to_tokens=lambda ids: [pieces[i] for i in ids])
        return SimpleNamespace(tokenizer=tokenizer)

    check_draft_model(loaded(["a", "b", "c"]), loaded(["a", "b", "c"]))
    with pytest.raises(ValueError, match="has 2 tokens, the target's 3"):
        check_draft_model(loaded(["a", "b", "c"]), loaded(["a", "b"]))
    with pytest.raises(ValueError, match="differs from the target's at 1 ids"):
        check_draft_model(loaded(["a", "b", "c"]), loaded(["a", "x", "c"]))


def test_a_missing_draft_model_fails_at_start_up(tiny_llama_checkpoint, tmp_path):
    with pytest.raises(Exception, match="no-such-draft"):
        LLM(str(tiny_llama_checkpoint[0]), speculative_config={"model": str(tmp_path / "no-such-draft")})


def test_the_break_even_counts_what_proposing_costs():
    """A draft model's proposals cost the step they are made in: a request's verifications must beat a decode
    step that makes none."""
    speculator = Speculator(SpeculativeConfig.parse({"model": "/some/draft", "num_speculative_tokens": 4}),
                            EngineStats())  # fmt: skip
    speculator.set_step_costs({1: 1.5, 5: 2.0}, plain_decode=1.0)  # proposing adds half a decode step
    assert speculator.break_even == pytest.approx(1.0)
    speculator.set_step_costs({1: 1.5, 5: 2.0})
    assert speculator.break_even == pytest.approx(2.0 / 1.5 - 1)
