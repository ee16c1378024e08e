"""Speculative decoding on tiny checkpoints: the output is the one decoding without speculation gives,
greedy or seeded, alone or in batches, with stops, logprobs, n > 1, prefix caching, chunked prefill and
preemption; sampling keeps the target distribution; bad configs are refused.

Random tiny models rarely repeat themselves, so n-gram lookups would propose little that is accepted.
Most tests therefore propose through an oracle: the continuation decoding without speculation gave, with
some tokens replaced, so every step verifies drafts of which some are accepted and some rejected (the
n-gram lookup itself is tested on its own here, and end to end on SmolLM2 in test_server_speculative)."""

import json

import numpy as np
import pytest
import torch

from jserve import LLM, SamplingParams, StructuredOutputsParams
from jserve.engine.compile_guard import compile_count
from jserve.engine.request import Request
from jserve.engine.scheduler import ScheduledSequence
from jserve.engine.stats import EngineStats
from jserve.spec_decode import SpeculativeConfig, Speculator, propose_ngram
from jserve.structured import GrammarMatcher

from test_engine import prompts as engine_prompts
from test_engine import tiny_llm, token_ids
from tiny_models import (
    VARIANTS,
    VOCAB_SIZE,
    assert_engine_idle,
    reference_greedy,
    release_compiled,
    save_tiny_checkpoint,
    tiny_kv_bytes,
)

NGRAM = {"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_max": 3, "prompt_lookup_min": 1,
         "disable_by_batch_size": 8}  # fmt: skip
GREEDY = SamplingParams(temperature=0, max_tokens=40, ignore_eos=True)


def prompts(count, seed=0, low=5, high=60):
    return engine_prompts(count, seed, low, high)


class Oracle:
    """Proposes what a request's completion will be (taught by `learn`), each draft token replaced by a
    random one with probability `noise`, so runs of drafts are accepted up to a random point."""

    def __init__(self, noise=0.3):
        self.known: dict[tuple, list[list[int]]] = {}
        self.rng = np.random.default_rng(0)
        self.noise = noise

    def learn(self, batch, outputs):
        self.teach(batch, [[c.token_ids for c in out.outputs] for out in outputs])

    def teach(self, batch, completions):
        """Each prompt's completions (lists of token ids, in the request's order)."""
        for prompt, tokens in zip(batch, completions, strict=True):
            self.known[tuple(prompt)] = tokens

    def lookup(self, request, count):
        completions = self.known.get(tuple(request.prompt_token_ids))
        if completions is None:
            return np.zeros(0, np.int32)
        done = request.num_output_tokens
        drafts = np.array(completions[request.index][done : done + count], np.int32)
        noisy = self.rng.random(len(drafts)) < self.noise
        drafts[noisy] = self.rng.integers(0, VOCAB_SIZE, int(noisy.sum()))
        return drafts


@pytest.fixture
def oracle(monkeypatch):
    oracle = Oracle()
    monkeypatch.setattr(Speculator, "lookup", lambda self, request, count: oracle.lookup(request, count))
    every_draft_verified(monkeypatch)
    return oracle


def every_draft_verified(monkeypatch):
    """Steps keep their drafts whatever the step costs timed at start-up say (timings on a busy machine vary,
    and these tests count drafts); test_drafts_are_kept_only_where_they_pay checks the choice itself."""
    monkeypatch.setattr(Speculator, "worthwhile", lambda self, sequences: sequences)


def run_both(plain, spec, oracle, batch, params):
    """Each engine's outputs for the batch, the speculative one proposing (noisy) plain outputs."""
    want = plain.generate(batch, params, use_tqdm=False)
    oracle.learn(batch, want)
    return want, spec.generate(batch, params, use_tqdm=False)


def spec_counts(llm) -> tuple[int, int]:
    stats = llm.engine.stats
    return stats.spec_draft_tokens, stats.spec_accepted_tokens


@pytest.fixture(scope="module")
def spec(tiny_llama_checkpoint):
    engine = tiny_llm(tiny_llama_checkpoint[0], speculative_config=NGRAM)
    yield engine
    assert_engine_idle(engine)


@pytest.fixture(autouse=True)
def pages_return(request):
    yield
    for name in ("plain", "spec"):
        if name in request.fixturenames:
            assert_engine_idle(request.getfixturevalue(name))
    release_compiled()  # many tests here build engines of their own: their executables go with them


@pytest.mark.parametrize("variant", sorted(VARIANTS))
def test_greedy_output_is_decoding_without_speculation_for_every_family(tmp_path, variant, oracle):
    family, overrides = VARIANTS[variant]
    reference = save_tiny_checkpoint(tmp_path, family, **overrides)
    batch = prompts(6, seed=1)
    want = [reference_greedy(reference, prompt, GREEDY.max_tokens) for prompt in batch]  # (no second engine)
    oracle.teach(batch, [[tokens] for tokens in want])
    speculative = tiny_llm(tmp_path, speculative_config=NGRAM)
    assert token_ids(speculative.generate(batch, GREEDY, use_tqdm=False)) == want
    drafted, accepted = spec_counts(speculative)
    assert 0 < accepted < drafted  # drafts were accepted and rejected
    assert_engine_idle(speculative)


def test_alone_and_in_a_batch(plain, spec, oracle):
    batch = prompts(7, seed=2)
    want, _ = run_both(plain, spec, oracle, batch, GREEDY)
    expected = token_ids(want)
    for i in (0, 3):
        assert token_ids(spec.generate([batch[i]], GREEDY, use_tqdm=False))[0] == expected[i]
    mixed = [SamplingParams(temperature=0, max_tokens=int(n), ignore_eos=True) for n in (5, 40, 17, 40, 2, 33, 40)]
    cut = [e[: p.max_tokens] for e, p in zip(expected, mixed, strict=True)]
    assert token_ids(spec.generate(batch, mixed, use_tqdm=False)) == cut


def test_seeded_sampling_gives_the_same_tokens_as_without_speculation(plain, spec, oracle):
    batch = prompts(6, seed=3)
    params = [SamplingParams(temperature=t, top_p=p, top_k=k, max_tokens=30, seed=s, ignore_eos=True)
              for t, p, k, s in [(1.0, 1.0, 0, 1), (0.7, 0.9, 0, 2), (1.3, 1.0, 5, 3), (0.5, 0.8, 20, 4),
                                 (1.0, 1.0, 0, 5), (0.0, 1.0, 0, 6)]]  # fmt: skip
    before = spec_counts(spec)
    want, got = run_both(plain, spec, oracle, batch, params)
    assert token_ids(got) == token_ids(want)
    drafted, accepted = (a - b for a, b in zip(spec_counts(spec), before, strict=True))
    assert 0 < accepted < drafted


def test_sampling_keeps_the_target_distribution(tiny_llama_checkpoint, monkeypatch):
    """2,400 seeded completions of three tokens: the prompt holds most tokens, so after almost any first
    token the n-gram lookup proposes a draft for the second. The (first, second) pairs must follow the
    model's exact distribution (top-k 3 at temperature 1, from transformers): a chi-square test over the 9
    cells."""
    every_draft_verified(monkeypatch)
    folder, reference = tiny_llama_checkpoint
    rng = np.random.default_rng(7)
    prompt = rng.permutation(VOCAB_SIZE)[:200].tolist()
    llm = tiny_llm(folder, speculative_config=NGRAM, enable_prefix_caching=True)
    draws = 2400
    params = [SamplingParams(temperature=1.0, top_k=3, max_tokens=3, seed=s, ignore_eos=True) for s in range(draws)]
    pairs = [tuple(ids[:2]) for ids in token_ids(llm.generate([prompt] * draws, params, use_tqdm=False))]
    assert llm.engine.stats.spec_drafts > draws / 2  # most second tokens were verified drafts
    assert_engine_idle(llm)

    def top3(ids):
        with torch.no_grad():
            logits = reference(torch.tensor([ids])).logits[0, -1].double().numpy()
        best = np.argsort(logits)[-3:]
        probs = np.exp(logits[best] - logits[best].max())
        return dict(zip(best.tolist(), probs / probs.sum(), strict=True))

    expected = {(a, b): pa * pb for a, pa in top3(prompt).items() for b, pb in top3(prompt + [a]).items()}
    assert set(pairs) <= set(expected)
    counts = np.array([sum(p == cell for p in pairs) for cell in expected])
    means = draws * np.array(list(expected.values()))
    chi2 = float(((counts - means) ** 2 / means).sum())
    assert chi2 < 26.1  # the 99.9th percentile of chi-square with 8 degrees of freedom


def test_stops_and_limits_inside_an_accepted_run(plain, spec, oracle):
    batch = prompts(4, seed=4)
    oracle.noise = 0.0  # whole runs accepted: the stops fall inside them
    oracle.learn(batch, plain.generate(batch, GREEDY, use_tqdm=False))
    free = [completions[0] for completions in oracle.known.values()]
    text = plain.get_tokenizer().decode(free[1])
    cases = [
        SamplingParams(temperature=0, max_tokens=40, stop_token_ids=[free[0][9]]),
        SamplingParams(temperature=0, max_tokens=40, stop=[text[10:14]]),
        SamplingParams(temperature=0, max_tokens=13, ignore_eos=True),
        SamplingParams(temperature=0, max_tokens=40, min_tokens=20, stop_token_ids=[free[3][4]]),
    ]
    for want, got in zip(plain.generate(batch, cases, use_tqdm=False), spec.generate(batch, cases, use_tqdm=False),
                         strict=True):  # fmt: skip
        w, g = want.outputs[0], got.outputs[0]
        assert (g.token_ids, g.text, g.finish_reason, g.stop_reason) == (w.token_ids, w.text, w.finish_reason,
                                                                          w.stop_reason)  # fmt: skip


def test_logprobs_are_the_target_models(plain, spec, oracle):
    batch = prompts(3, seed=5)
    params = SamplingParams(temperature=0, max_tokens=30, logprobs=3, ignore_eos=True)
    for want, got in zip(*run_both(plain, spec, oracle, batch, params), strict=True):
        w, g = want.outputs[0], got.outputs[0]
        assert g.token_ids == w.token_ids
        for w_entry, g_entry in zip(w.logprobs, g.logprobs, strict=True):
            assert list(g_entry) == list(w_entry)
            np.testing.assert_allclose([lp.logprob for lp in g_entry.values()],
                                       [lp.logprob for lp in w_entry.values()], atol=1e-4)  # fmt: skip
        np.testing.assert_allclose(g.cumulative_logprob, w.cumulative_logprob, atol=1e-3)


def test_n_completions_and_streaming(plain, spec, oracle):
    prompt = prompts(1, seed=6)[0]
    params = SamplingParams(n=3, temperature=0.8, max_tokens=25, seed=11, ignore_eos=True)
    want, got = run_both(plain, spec, oracle, [prompt], params)
    assert [c.token_ids for c in got[0].outputs] == [c.token_ids for c in want[0].outputs]
    whole, _ = run_both(plain, spec, oracle, [prompt], GREEDY)
    engine, streamed, deltas = spec.engine, [], 0
    engine.add_request(prompt, GREEDY, request_id="streamed")
    while engine.has_unfinished_requests():
        for out in engine.step():
            streamed += out.outputs[0].delta_token_ids
            deltas += bool(out.outputs[0].delta_token_ids)
    assert streamed == whole[0].outputs[0].token_ids
    assert deltas < len(streamed)  # verified runs arrive several tokens to a delta
    assert "".join(spec.stream(prompt, GREEDY)) == whole[0].outputs[0].text


def test_structured_outputs_cut_and_verify_drafts_under_the_grammar(plain, spec, oracle, monkeypatch):
    """Drafts a grammar forbids are cut before the step; the rest are verified under the masks of the grammar
    advanced through the drafts before them, and the matcher sees only accepted tokens."""
    schema = {
        "type": "object",
        "properties": {
            "a": {"type": "integer"},
            "b": {"type": "array", "items": {"type": "string", "maxLength": 5}, "maxItems": 3},
        },
        "required": ["a", "b"],
        "additionalProperties": False,
    }
    constraints = [StructuredOutputsParams(json=schema), StructuredOutputsParams(regex="(ab|cd)+e{2,9}"),
                   StructuredOutputsParams(choice=["alpha beta gamma", "the quick brown fox"])]  # fmt: skip
    batch = prompts(6, seed=12)
    params = [SamplingParams(temperature=t, seed=i, max_tokens=60, structured_outputs=constraints[i % 3])
              for i, t in enumerate([0, 0, 0, 0.9, 0.9, 0.9])]  # fmt: skip
    oracle.noise = 0.15
    cuts, valid_prefix = [], GrammarMatcher.valid_prefix

    def counting_cuts(matcher, drafts):
        valid = valid_prefix(matcher, drafts)
        cuts.append(valid < len(drafts))
        return valid

    monkeypatch.setattr(GrammarMatcher, "valid_prefix", counting_cuts)
    before = spec_counts(spec)
    want, got = run_both(plain, spec, oracle, batch, params)
    for w, g in zip(want, got, strict=True):
        assert g.outputs[0].token_ids == w.outputs[0].token_ids
        assert g.outputs[0].finish_reason == w.outputs[0].finish_reason
    assert json.loads(got[0].outputs[0].text)["b"] is not None
    drafted, accepted = (a - b for a, b in zip(spec_counts(spec), before, strict=True))
    assert 0 < accepted <= drafted
    assert any(cuts)  # the grammar cut some drafts


def test_prefix_cache_chunked_prefill_and_preemption(tiny_llama_checkpoint, plain, oracle):
    batch = prompts(8, seed=8, low=30, high=70)
    params = SamplingParams(temperature=0, max_tokens=50, ignore_eos=True)
    want = plain.generate(batch, params, use_tqdm=False)
    oracle.learn(batch, want)
    expected = token_ids(want)
    folder = tiny_llama_checkpoint[0]
    cached = tiny_llm(folder, speculative_config=NGRAM, enable_prefix_caching=True)
    for _ in range(2):  # the second round reads the prompts' pages from the cache
        assert token_ids(cached.generate(batch, params, use_tqdm=False)) == expected
    assert cached.engine.stats.prefix_cache_hits > 0
    assert_engine_idle(cached)  # every cached page holds verified tokens: the cache's invariants hold
    chunked = tiny_llm(folder, speculative_config=NGRAM, max_num_batched_tokens=32)
    assert token_ids(chunked.generate(batch, params, use_tqdm=False)) == expected
    assert_engine_idle(chunked)
    cramped = tiny_llm(folder, speculative_config=NGRAM, kv_cache_memory=tiny_kv_bytes(24))
    outputs = cramped.generate(batch, params, use_tqdm=False)
    assert sum(o.metrics.num_preemptions for o in outputs) > 0
    assert token_ids(outputs) == expected
    assert spec_counts(cramped)[1] > 0
    assert_engine_idle(cramped)


def test_drafts_are_kept_only_where_they_pay():
    stats = EngineStats()
    speculator = Speculator(SpeculativeConfig.parse({"num_speculative_tokens": 4}), stats)
    # Steps cost little up to 5 tokens, then a lot: one request's drafts pay, a second one's do not.
    speculator.set_step_costs({1: 1.0, 2: 1.0, 5: 1.2, 10: 4.0})
    assert speculator.break_even == pytest.approx(0.2)
    requests = [Request(str(i), [1, 2, 3], SamplingParams(), seed=0, arrival_index=i, max_model_len=64)
                for i in range(2)]  # fmt: skip
    sequences = [ScheduledSequence(r, 2, 5, drafts=np.array([4, 5, 6, 7], np.int32)) for r in requests]
    speculator.accepted(requests[0], 4, 4)  # the first request's drafts have been accepted, the second's hardly
    speculator.accepted(requests[1], 4, 1)
    kept = speculator.worthwhile(sequences)
    assert [len(s.drafts) for s in kept] == [4, 0] and [s.num_tokens for s in kept] == [5, 1]
    speculator.set_step_costs({1: 1.0, 2: 1.0, 5: 1.0, 10: 1.0})  # drafts cost nothing: all of them stay
    assert [len(s.drafts) for s in speculator.worthwhile(sequences)] == [4, 4]


def test_big_batches_do_not_speculate_and_nothing_compiles(tiny_llama_checkpoint, plain, spec, oracle):
    batch, params = prompts(8, seed=9), SamplingParams(temperature=0.5, top_k=5, max_tokens=30, seed=3)
    before = compile_count()
    run_both(plain, spec, oracle, batch, params)
    assert compile_count() == before
    narrow = tiny_llm(tiny_llama_checkpoint[0], speculative_config=NGRAM | {"disable_by_batch_size": 2})
    narrow.generate(batch, GREEDY, use_tqdm=False)  # 8 running: none speculates until 2 are left
    drafts_at_the_end = narrow.engine.stats.spec_drafts
    oracle.learn(batch, plain.generate(batch, GREEDY, use_tqdm=False))
    narrow.generate(batch[:2], GREEDY, use_tqdm=False)
    assert narrow.engine.stats.spec_drafts > drafts_at_the_end
    assert_engine_idle(narrow)


@pytest.mark.parametrize(
    "config, message",
    [
        ("{not json", "not valid JSON"),
        ('["ngram"]', "JSON object"),
        ({"method": "eagle"}, "method must be one of"),
        ({"method": "ngram", "num_speculative_tokens": 0}, "num_speculative_tokens must be a positive integer"),
        ({"method": "ngram", "num_speculative_tokens": 40}, "at most 16"),
        ({"method": "ngram", "prompt_lookup_min": 5, "prompt_lookup_max": 2}, "exceeds prompt_lookup_max"),
        ({"method": "ngram", "prompt_lookup_max": "4"}, "prompt_lookup_max must be a positive integer"),
        ({"method": "ngram", "lookahead": 3}, "unknown key"),
    ],
)
def test_bad_configs_are_refused(config, message):
    with pytest.raises(ValueError, match=message):
        SpeculativeConfig.parse(config)


def test_config_defaults_follow_vllm():
    assert SpeculativeConfig.parse(json.dumps({"method": "ngram", "prompt_lookup_max": 4})).prompt_lookup_min == 4
    both = SpeculativeConfig.parse({"method": "ngram"})
    assert (both.prompt_lookup_min, both.prompt_lookup_max, both.num_speculative_tokens) == (5, 5, 4)


def test_lookup_proposes_what_followed_the_longest_latest_match():
    tokens = np.array([1, 2, 3, 4, 5, 9, 2, 3, 7, 1, 2, 3])
    assert propose_ngram(tokens, 1, 3, 3).tolist() == [4, 5, 9]  # "1 2 3" beats the later "2 3"
    assert propose_ngram(tokens, 1, 2, 2).tolist() == [7, 1]  # longest is 2: the latest "2 3"
    assert propose_ngram(tokens, 4, 4, 3).tolist() == []
    assert propose_ngram(np.array([5, 6, 7]), 1, 3, 2).tolist() == []


def test_a_bad_config_fails_before_the_model_loads(tmp_path):
    with pytest.raises(ValueError, match="unknown key"):
        LLM(str(tmp_path / "no-such-model"), speculative_config={"method": "ngram", "k": 3})
