"""Prefix caching end to end on a tiny checkpoint: outputs identical with the cache on and off, hits reported,
no pages leaked, salts isolated."""

import numpy as np
import pytest

from jserve import SamplingParams

from test_engine import GREEDY, prompts, tiny_llm, token_ids
from tiny_models import VOCAB_SIZE, assert_engine_idle, tiny_kv_bytes

SYSTEM = np.random.default_rng(42).integers(0, VOCAB_SIZE, 70).tolist()  # a shared "system prompt"


def with_system(count: int, seed: int) -> list[list[int]]:
    return [SYSTEM + p for p in prompts(count, seed=seed, low=3, high=30)]


@pytest.fixture(scope="module")
def plain(tiny_llama_checkpoint):
    return tiny_llm(tiny_llama_checkpoint[0])


@pytest.fixture(scope="module")
def cached(tiny_llama_checkpoint):
    engine = tiny_llm(tiny_llama_checkpoint[0], enable_prefix_caching=True)
    yield engine
    assert_engine_idle(engine)


@pytest.fixture(autouse=True)
def idle_after(request):
    yield
    if "cached" in request.fixturenames:
        assert_engine_idle(request.getfixturevalue("cached"))


def test_shared_prefixes_hit_and_change_nothing(plain, cached):
    first, second = with_system(6, seed=1), with_system(6, seed=2)
    expected = token_ids(plain.generate(first + second, GREEDY, use_tqdm=False))
    outs = cached.generate(first, GREEDY, use_tqdm=False) + cached.generate(second, GREEDY, use_tqdm=False)
    assert token_ids(outs) == expected
    # The second batch finds the 64 whole-page tokens of the system prompt cached.
    assert all(o.num_cached_tokens >= 64 for o in outs[6:])
    stats = cached.engine.stats
    assert 0 < stats.prefix_cache_hits <= stats.prefix_cache_queries


def test_a_repeated_prompt_reuses_all_but_its_last_token(cached):
    prompt = prompts(1, seed=3, low=40, high=41)[0]  # 40 tokens: two whole pages and a partial one
    cached.generate([prompt], GREEDY, use_tqdm=False)
    again = cached.generate([prompt], GREEDY, use_tqdm=False)[0]
    assert again.num_cached_tokens == 32
    exact = prompts(1, seed=4, low=48, high=49)[0]  # 48 tokens: the last page holds the last token
    cached.generate([exact], GREEDY, use_tqdm=False)
    assert cached.generate([exact], GREEDY, use_tqdm=False)[0].num_cached_tokens == 32


def test_generated_tokens_are_cached_for_the_next_turn(plain, cached):
    turn = with_system(1, seed=5)[0]
    reply = cached.generate([turn], GREEDY, use_tqdm=False)[0].outputs[0].token_ids
    follow_up = turn + reply + [7, 8, 9]
    out = cached.generate([follow_up], GREEDY, use_tqdm=False)[0]
    assert out.num_cached_tokens >= (len(turn) + len(reply) - 1) // 16 * 16
    assert out.outputs[0].token_ids == token_ids(plain.generate([follow_up], GREEDY, use_tqdm=False))[0]


@pytest.mark.parametrize("chunk", [8, 32])
def test_chunked_prefill_with_the_cache(tiny_llama_checkpoint, plain, chunk):
    batch = with_system(5, seed=6)
    expected = token_ids(plain.generate(batch, GREEDY, use_tqdm=False))
    engine = tiny_llm(tiny_llama_checkpoint[0], enable_prefix_caching=True, max_num_batched_tokens=chunk)
    assert token_ids(engine.generate(batch, GREEDY, use_tqdm=False)) == expected
    assert token_ids(engine.generate(batch[::-1], GREEDY, use_tqdm=False)) == expected[::-1]
    assert_engine_idle(engine)


def test_eviction_and_preemption_keep_outputs(tiny_llama_checkpoint, plain):
    batch = with_system(8, seed=7) + prompts(8, seed=8, low=20, high=40)
    params = SamplingParams(temperature=0, max_tokens=60, ignore_eos=True)
    expected = token_ids(plain.generate(batch, params, use_tqdm=False))
    cramped = tiny_llm(tiny_llama_checkpoint[0], enable_prefix_caching=True, kv_cache_memory=tiny_kv_bytes(24))
    for _ in range(2):  # the second round runs against a full cache that must be evicted from
        outputs = cramped.generate(batch, params, use_tqdm=False)
        assert token_ids(outputs) == expected
    assert sum(o.metrics.num_preemptions for o in outputs) > 0
    assert_engine_idle(cramped)


def test_n_siblings_prefill_the_prompt_once(cached):
    prompt = SYSTEM + [1, 2, 3]
    before = cached.engine.stats.prompt_tokens
    out = cached.generate([prompt], SamplingParams(n=4, temperature=1.0, seed=3, max_tokens=5), use_tqdm=False)[0]
    computed = cached.engine.stats.prompt_tokens - before
    cached_pages = (len(prompt) - 1) // 16 * 16
    assert computed <= len(prompt) + 3 * (len(prompt) - cached_pages), computed
    assert len(out.outputs) == 4


def test_sampling_with_and_without_penalties_matches(plain, cached):
    batch = with_system(4, seed=9)
    for params in (
        SamplingParams(temperature=0.8, seed=11, max_tokens=16, ignore_eos=True),
        SamplingParams(temperature=0, repetition_penalty=1.3, frequency_penalty=0.5, max_tokens=16, ignore_eos=True),
    ):
        expected = token_ids(plain.generate(batch, params, use_tqdm=False))
        cached.generate(batch, params, use_tqdm=False)  # warm the cache with these prompts
        assert token_ids(cached.generate(batch, params, use_tqdm=False)) == expected


def test_the_engine_checks_its_pages_and_cache_whenever_it_goes_idle(cached):
    pool = cached.engine.scheduler.kv.pool
    leaked = pool.allocate(1)  # a page held by no request and not cached
    with pytest.raises(AssertionError, match="reference counts differ from holders"):
        cached.generate([[1, 2, 3]], GREEDY, use_tqdm=False)
    pool.release(leaked)


def test_cache_salt_isolates_tenants(cached):
    prompt = prompts(1, seed=10, low=50, high=51)[0]
    engine = cached.engine
    engine.add_request(prompt, GREEDY, request_id="a", cache_salt="tenant-a")
    while engine.has_unfinished_requests():
        engine.step()
    results = {}
    for rid, salt in (("b", "tenant-b"), ("c", "tenant-a"), ("d", None)):
        engine.add_request(prompt, GREEDY, request_id=rid, cache_salt=salt)
        while engine.has_unfinished_requests():
            for out in engine.step():
                results[out.request_id] = out
    assert results["b"].num_cached_tokens == 0 and results["d"].num_cached_tokens == 0
    assert results["c"].num_cached_tokens == 48
    assert token_ids([results["b"], results["c"]])[0] == token_ids([results["b"], results["c"]])[1]
