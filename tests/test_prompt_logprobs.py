"""Prompt logprobs: every prompt token scored by the model, as transformers' log_softmax scores it, whatever
the chunking, the batch, the prefix cache or preemption."""

import numpy as np
import pytest
from scipy.special import log_softmax

from jserve import SamplingParams
from jserve.engine.compile_guard import compile_count
from jserve.errors import RequestError

from test_engine import prompts, tiny_llm
from tiny_models import VARIANTS, assert_engine_idle, reference_logits, save_tiny_checkpoint, tiny_kv_bytes

TOP = 3


def scored(params_top=TOP, **kwargs) -> SamplingParams:
    return SamplingParams(**{"temperature": 0, "max_tokens": 2, "prompt_logprobs": params_top} | kwargs)


def as_arrays(prompt_logprobs, ids):
    """(each token's logprob, its rank, the top ids) from position 1 on."""
    entries = prompt_logprobs[1:]
    chosen = np.array([e[t].logprob for e, t in zip(entries, ids[1:], strict=True)])
    ranks = [e[t].rank for e, t in zip(entries, ids[1:], strict=True)]
    tops = [[tid for tid, lp in sorted(e.items(), key=lambda kv: kv[1].rank) if lp.rank <= TOP] for e in entries]
    return chosen, ranks, tops


@pytest.mark.parametrize("variant", sorted(VARIANTS))
def test_prompt_logprobs_match_transformers(tmp_path, variant):
    family, overrides = VARIANTS[variant]
    reference = save_tiny_checkpoint(tmp_path, family, **overrides)
    engine = tiny_llm(tmp_path, max_num_batched_tokens=32)  # prompts of 40-90 tokens are chunked
    batch = prompts(3, seed=2, low=40, high=90)
    outputs = engine.generate(batch, scored(), use_tqdm=False)
    for ids, out in zip(batch, outputs, strict=True):
        assert len(out.prompt_logprobs) == len(ids) and out.prompt_logprobs[0] is None
        expected = log_softmax(reference_logits(reference, ids).astype(np.float64), axis=-1)[:-1]
        chosen, ranks, tops = as_arrays(out.prompt_logprobs, ids)
        np.testing.assert_allclose(chosen, expected[np.arange(len(ids) - 1), ids[1:]], atol=1e-4)
        # A rank counts the tokens above the chosen one: one within float32 noise of it (Gemma's soft-capped
        # logits have some) may fall on either side.
        for rank, row, t in zip(ranks, expected, ids[1:], strict=True):
            assert 1 + (row > row[t] + 1e-4).sum() <= rank <= 1 + (row > row[t] - 1e-4).sum()
        for row, top in zip(expected, tops, strict=True):
            np.testing.assert_allclose(row[top], np.sort(row)[::-1][:TOP], atol=1e-4)
        for entry in out.prompt_logprobs[1:]:
            assert all(lp.decoded_token is not None for lp in entry.values())
    assert_engine_idle(engine)


def test_scores_do_not_depend_on_chunks_batch_cache_or_preemption(tiny_llama_checkpoint):
    folder = tiny_llama_checkpoint[0]
    probe = prompts(1, seed=3, low=70, high=71)[0]
    alone = tiny_llm(folder, enable_prefix_caching=True)
    expected = alone.generate([probe], scored(), use_tqdm=False)[0].prompt_logprobs
    # the same prompt again, now cached by a plain request: a scoring request still scores every token
    alone.generate([probe], SamplingParams(max_tokens=1), use_tqdm=False)
    again = alone.generate([probe], scored(), use_tqdm=False)[0]
    assert again.prompt_logprobs == expected
    assert_engine_idle(alone)
    # in a batch of others, chunked small, in a cramped cache that preempts
    cramped = tiny_llm(folder, max_num_batched_tokens=16, kv_cache_memory=tiny_kv_bytes(20))
    others = prompts(6, seed=4, low=30, high=60)
    params = [SamplingParams(temperature=0, max_tokens=40, ignore_eos=True)] * 6 + [scored(max_tokens=30)]
    outputs = cramped.generate([*others, probe], params, use_tqdm=False)
    assert sum(o.metrics.num_preemptions for o in outputs) > 0
    got, want = as_arrays(outputs[-1].prompt_logprobs, probe), as_arrays(expected, probe)
    np.testing.assert_allclose(got[0], want[0], atol=1e-5)
    assert got[1:] == want[1:]
    assert all(o.prompt_logprobs is None for o in outputs[:-1])
    assert_engine_idle(cramped)


def test_scoring_compiles_nothing_and_bad_values_are_refused(tiny_llama_checkpoint):
    engine = tiny_llm(tiny_llama_checkpoint[0])
    before = compile_count()
    out = engine.generate(prompts(2, seed=5), scored(0), use_tqdm=False)
    assert compile_count() == before
    assert all(len(e) == 1 for e in out[0].prompt_logprobs[1:])  # the token itself only, with k = 0
    for bad in (-1, 21, True):
        with pytest.raises(RequestError) as error:
            SamplingParams(prompt_logprobs=bad)
        assert error.value.param == "prompt_logprobs"
