"""The sampler against a float64 numpy reference, its penalty history, and the statistics of its draws."""

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from sampling_rows import SamplingRow, build_sampling_batch

from jserve.engine import sampler
from jserve.engine.sampler import (
    BIAS_WIDTH,
    TOP_HEAD,
    PenaltyState,
    bias_entries,
    full_bitmask,
    init_penalty_state,
    process_logits,
    sample,
    update_penalty_state,
)
from jserve.sampling_params import MAX_LOGPROBS, SamplingParams

VOCAB = 64
NUM_SLOTS = 6
# Jitted once here so the tests share compilations (one per distinct shape).
SAMPLE = jax.jit(sample)
PROCESS = jax.jit(process_logits)
UPDATE = jax.jit(update_penalty_state)
# Each slot's history as (prompt tokens, output tokens); output tokens repeat to exercise the counts.
HISTORIES = {
    0: ([1, 2, 3, 4, 5, 6, 7, 8], [9, 9, 9, 10]),
    1: ([11, 12, 13, 14, 15, 16], [17, 18, 18, 11, 12]),
    2: ([20, 21, 22], []),
    3: ([], [30, 31, 31, 31, 32, 33]),
    4: (list(range(40, 60)), [40, 41, 42, 60, 61, 61]),
    5: ([0], [0, 0]),
}


def softmax(x):
    e = np.exp(x - x.max())
    return e / e.sum()


def reference_process(logits, params, suppressed=(), history=((), ())):
    """process_logits for one row, in float64 and written from the definitions rather than as thresholds."""
    x = np.array(logits, np.float64)
    for token, bias in params.logit_bias.items():
        x[token] += bias
    x[list(suppressed)] = -np.inf
    prompt, output = history
    counts = np.bincount(np.array(output, int), minlength=len(x))
    seen = counts > 0
    seen[list(prompt)] = True
    rep = params.repetition_penalty
    x = np.where(seen, np.where(x > 0, x / rep, x * rep), x)
    x = x - params.frequency_penalty * counts - params.presence_penalty * (counts > 0)
    if params.greedy:
        return x
    x = x / params.temperature
    if 0 < params.top_k < len(x):
        x[x < np.sort(x)[::-1][params.top_k - 1]] = -np.inf
    if params.top_p < 1:
        order = np.argsort(-x, kind="stable")
        cumulative = np.cumsum(softmax(x)[order])
        last = min(np.searchsorted(cumulative, params.top_p), len(x) - 1)  # first rank reaching top_p
        x[x < x[order[last]]] = -np.inf
    if params.min_p > 0:
        p = softmax(x)
        x[p < params.min_p * p.max()] = -np.inf
    return x


def history_state(histories=HISTORIES, num_slots=NUM_SLOTS, vocab=VOCAB):
    mask = np.zeros((num_slots, vocab), bool)
    counts = np.zeros((num_slots, vocab), np.int32)
    for slot, (prompt, output) in histories.items():
        mask[slot, prompt] = True
        np.add.at(counts[slot], output, 1)
    return PenaltyState(jnp.asarray(mask), jnp.asarray(counts))


def assert_processed_equal(actual, expected):
    actual = np.asarray(actual)
    np.testing.assert_array_equal(np.isneginf(actual), np.isneginf(expected), err_msg="different tokens filtered out")
    kept = np.isfinite(expected)
    np.testing.assert_allclose(actual[kept], expected[kept], rtol=1e-5, atol=1e-5)


def random_logits(rows, vocab=VOCAB, scale=2.0, seed=0):
    return np.random.default_rng(seed).normal(scale=scale, size=(rows, vocab)).astype(np.float32)


OPTIONS = {
    "bias": (SamplingParams(temperature=0, logit_bias={3: 5.0, 10: -7.5, 63: 100, 9: 0.25}), ()),
    "suppressed": (SamplingParams(temperature=0.9), (0, 5, 17)),
    "bias and suppressed": (SamplingParams(logit_bias={5: 3.0, 6: -2.0}), (5, 7)),
    "repetition": (SamplingParams(temperature=0, repetition_penalty=1.7), ()),
    "repetition below 1": (SamplingParams(temperature=0, repetition_penalty=0.6), ()),
    "presence": (SamplingParams(temperature=0, presence_penalty=1.5), ()),
    "frequency": (SamplingParams(temperature=0, frequency_penalty=-0.8), ()),
    "greedy ignores the filters": (SamplingParams(temperature=0, top_k=3, top_p=0.5, min_p=0.3), ()),
    "temperature": (SamplingParams(temperature=0.6), ()),
    "tiny temperature": (SamplingParams(temperature=1e-3), ()),
    "top_k": (SamplingParams(top_k=5), ()),
    "top_k 1": (SamplingParams(top_k=1, temperature=2.0), ()),
    "top_k of the whole vocabulary": (SamplingParams(top_k=VOCAB), ()),
    "top_k above the vocabulary": (SamplingParams(top_k=10 * VOCAB), ()),
    "top_p": (SamplingParams(top_p=0.7), ()),
    "top_p tiny": (SamplingParams(top_p=1e-6, temperature=0.5), ()),
    "min_p": (SamplingParams(min_p=0.2), ()),
    "top_k and top_p": (SamplingParams(top_k=10, top_p=0.6, temperature=1.3), ()),
    "top_p and min_p": (SamplingParams(top_p=0.9, min_p=0.1, temperature=0.8), ()),
    "everything": (
        SamplingParams(
            temperature=0.8,
            top_k=12,
            top_p=0.85,
            min_p=0.05,
            repetition_penalty=1.3,
            presence_penalty=0.4,
            frequency_penalty=0.3,
            logit_bias={2: 2.0, 9: -1.0, 40: 4.0},
        ),
        (1, 2),
    ),
}


def pack(rows, num_seqs, vocab=VOCAB):
    """The rows as a batch of num_seqs, no row constrained by a grammar."""
    return build_sampling_batch(rows, num_seqs, full_bitmask(num_seqs, vocab))


def rows_for(options, num_seqs_pad=2, vocab=VOCAB):
    """One row per (params, suppressed), slots spread over the histories; the batch gets padding rows."""
    rows = [
        SamplingRow(params, seed=i, step=0, slot=(2 * i + 1) % NUM_SLOTS, suppressed_ids=suppressed)
        for i, (params, suppressed) in enumerate(options)
    ]
    return rows, pack(rows, len(rows) + num_seqs_pad, vocab)


def check_against_reference(options, logits, state=None, histories=HISTORIES):
    rows, batch = rows_for(options, vocab=logits.shape[-1])
    state = history_state(histories) if state is None else state
    processed = np.asarray(PROCESS(logits, batch, state))
    for i, row in enumerate(rows):
        expected = reference_process(logits[i], row.params, row.suppressed_ids, histories.get(row.slot, ((), ())))
        assert_processed_equal(processed[i], expected)
    assert np.isfinite(processed[len(rows) :]).all(), "padding rows must stay finite"
    return processed


@pytest.mark.parametrize("name", OPTIONS)
def test_each_option_matches_reference(name):
    # the option's row twice (different logits and histories) beside a plain greedy and a plain sampling row
    option = OPTIONS[name]
    options = [option, (SamplingParams(temperature=0), ()), option, (SamplingParams(), ())]
    check_against_reference(options, random_logits(len(options) + 2))


def test_all_options_mixed_in_one_batch_match_reference():
    options = list(OPTIONS.values()) * 2
    check_against_reference(options, random_logits(len(options) + 2, seed=1))


@pytest.mark.parametrize(
    "params,head_decides",
    [
        (SamplingParams(top_p=0.9), True),
        (SamplingParams(top_k=700, top_p=0.95), True),
        (SamplingParams(top_p=0.9, temperature=30.0), False),  # flat: the best TOP_HEAD hold < 0.9
        (SamplingParams(top_k=TOP_HEAD + 500), False),  # k beyond the head
        (SamplingParams(top_k=TOP_HEAD + 500, top_p=0.97, min_p=1e-4, temperature=3.0), False),
    ],
)
def test_large_vocabulary_head_and_whole_row_sort_match_reference(params, head_decides):
    vocab = 3 * TOP_HEAD
    logits = random_logits(5, vocab, scale=3.0, seed=2)
    scaled = logits[0].astype(np.float64) / params.temperature
    head_mass = np.sort(softmax(scaled))[::-1][:TOP_HEAD].sum()
    # which path the case takes: a top-k set inside the head holds all of the top-p mass
    assert (params.top_k <= TOP_HEAD and (params.top_k > 0 or head_mass >= params.top_p)) == head_decides
    options = [(params, ()), (SamplingParams(temperature=0), ()), (SamplingParams(top_p=0.5), ())]
    check_against_reference(options, logits, init_penalty_state(NUM_SLOTS, vocab), histories={})


def test_ties_at_the_threshold_are_kept():
    logits = np.array([[3, 2, 2, 2, 1, 0], [1, 1, 1, 1, 0, 0], [0, 0, 0, 0, 0, 0]], np.float32)
    half = float(jnp.log(jnp.float32(0.5)))  # p = 0.5 * p_max exactly, as the device computes it
    logits[2] = [0.0, half, half - 1e-3, -5, -5, -5]
    options = [(SamplingParams(top_k=2), ()), (SamplingParams(top_p=0.3), ()), (SamplingParams(min_p=0.5), ())]
    _, batch = rows_for(options, num_seqs_pad=0, vocab=6)
    kept = np.isfinite(np.asarray(PROCESS(logits, batch, init_penalty_state(NUM_SLOTS, 6))))
    np.testing.assert_array_equal(kept[0], [1, 1, 1, 1, 0, 0])  # top-2 keeps every token equal to the 2nd
    np.testing.assert_array_equal(kept[1], [1, 1, 1, 1, 0, 0])  # top-p needs 2 tokens of 4 equal ones
    np.testing.assert_array_equal(kept[2], [1, 1, 0, 0, 0, 0])  # min-p keeps exactly min_p * p_max


def test_update_penalty_state_resets_and_records():
    state = history_state()
    tokens = [1, 3, 3, 5, 7, 7, 4, 4, 6]
    slots = [2, 2, 2, 0, 1, 1, 3, 3, 3]
    is_output = [0, 0, 0, 0, 1, 1, 1, 1, 0]
    valid = [1, 1, 1, 1, 0, 0, 1, 1, 1]  # the two tokens for slot 1 are padding
    reset_slots, reset = [2, 0, 4, 0], [1, 1, 0, 0]  # slot 4 is listed but not reset; the last entry is padding
    args = [np.array(a, np.int32) for a in (tokens, slots)] + [np.array(a, bool) for a in (is_output, valid)]
    new = UPDATE(state, *args, np.array(reset_slots, np.int32), np.array(reset, bool))
    expected = dict(HISTORIES)
    expected[2] = ([1, 3], [])  # reset, then its prompt tokens; a repeated prompt token is just present
    expected[0] = ([5], [])
    expected[3] = ([6], HISTORIES[3][1] + [4, 4])  # not reset: a prompt token and two output tokens added
    want = history_state(expected)
    np.testing.assert_array_equal(new.prompt_mask, want.prompt_mask)
    np.testing.assert_array_equal(new.output_counts, want.output_counts)


def test_update_penalty_state_recomputes_a_preempted_request_from_scratch():
    state = history_state()
    # slot 5 restarts: prompt [8, 9] and its 3 generated tokens fed again as input in one step
    tokens, slots = np.array([8, 9, 12, 12, 13, 0], np.int32), np.array([5, 5, 5, 5, 5, 0], np.int32)
    is_output, valid = np.array([0, 0, 1, 1, 1, 0], bool), np.array([1, 1, 1, 1, 1, 0], bool)
    new = UPDATE(state, tokens, slots, is_output, valid, np.array([5], np.int32), np.array([True]))
    want = history_state({**HISTORIES, 5: ([8, 9], [12, 12, 13])})
    np.testing.assert_array_equal(new.prompt_mask, want.prompt_mask)
    np.testing.assert_array_equal(new.output_counts, want.output_counts)


def test_penalties_follow_the_history_update():
    # the same row sampled before and after its output grows: the new token is penalised
    state = init_penalty_state(2, VOCAB)
    logits = random_logits(1)
    top = int(np.argmax(logits[0]))
    batch = pack([SamplingRow(SamplingParams(temperature=0, presence_penalty=2.0), 0, 0, 1)], 1)
    before = np.asarray(PROCESS(logits, batch, state))
    token, slot, yes, no = np.array([top]), np.array([1]), np.array([True]), np.array([False])
    state = UPDATE(state, token, slot, yes, yes, slot, no)
    after = np.asarray(PROCESS(logits, batch, state))
    assert after[0, top] == pytest.approx(before[0, top] - 2.0)
    np.testing.assert_array_equal(np.delete(after, top), np.delete(before, top))


def test_greedy_rows_take_the_argmax_of_the_processed_logits():
    options = [(p, s) for p, s in OPTIONS.values() if p.greedy] + [(SamplingParams(temperature=0), (7,))]
    options += [(SamplingParams(), ())]  # a sampling row, so the random draw runs for the batch
    logits = random_logits(len(options) + 2, seed=3)
    rows, batch = rows_for(options)
    state = history_state()
    out = SAMPLE(logits, batch, state)
    processed = np.asarray(PROCESS(logits, batch, state))
    greedy = [i for i, r in enumerate(rows) if r.params.greedy]
    np.testing.assert_array_equal(np.asarray(out.token_ids)[greedy], processed[greedy].argmax(-1))
    # and the penalties matter: at least one greedy row picks something other than the raw argmax
    assert (np.asarray(out.token_ids)[greedy] != logits[greedy].argmax(-1)).any()


def test_all_greedy_batches_take_the_argmax_of_the_processed_logits():
    # Without a sampling row the step skips the filters and the noise, and without a bias or penalty
    # also the processed copy of the logits: each case still picks the processed argmax.
    logits = random_logits(6, seed=5)  # 4 rows and the batch's 2 padding rows
    state = history_state()
    plain = [(SamplingParams(temperature=0), ())] * 4
    greedy = SamplingParams(temperature=0)
    penalised, biased = (
        dataclasses.replace(greedy, repetition_penalty=1.7),
        dataclasses.replace(greedy, logit_bias={3: 50.0}),
    )
    adjusted = [(penalised, ()), (greedy, (9,)), (biased, ()), (greedy, ())]
    for options in (plain, adjusted):
        _, batch = rows_for(options)
        out = np.asarray(SAMPLE(logits, batch, state).token_ids)
        np.testing.assert_array_equal(out, np.asarray(PROCESS(logits, batch, state)).argmax(-1))
    assert out[2] == 3


@pytest.mark.parametrize("vocab", [64, 97, 1000, 49152, 151936])
def test_blockwise_argmax_is_numpys_argmax(vocab):
    rng = np.random.default_rng(vocab)
    x = rng.standard_normal((6, vocab)).astype(np.float32)
    x[1, [5, vocab - 1]] = 100.0  # a tie: the first wins
    x[3] = -np.inf
    x[4, -1] = np.inf
    x[5, :] = 7.0
    nan = x.copy()
    nan[2, [vocab // 2, vocab - 3]] = np.nan  # NaN wins, the first of them
    for logits in (x, nan):
        np.testing.assert_array_equal(np.asarray(jax.jit(sampler._argmax)(logits)), np.argmax(logits, axis=-1))
    assert np.argmax(nan, axis=-1)[2] == vocab // 2


DRAWS = 4000


def draw(logits_row, params, num_draws=DRAWS, suppressed=(), seeds=None, steps=None):
    """num_draws tokens for one logits row, one per batch row, each with its own seed (default: the row's
    index) and step (default 0). The batch always has DRAWS rows, so every call shares one compilation."""
    seeds = range(num_draws) if seeds is None else seeds
    steps = [0] * num_draws if steps is None else steps
    rows = [SamplingRow(params, seed, step, 0, suppressed) for seed, step in zip(seeds, steps, strict=True)]
    logits = np.broadcast_to(np.asarray(logits_row, np.float32), (DRAWS, len(logits_row)))
    out = SAMPLE(logits, pack(rows, DRAWS, len(logits_row)), init_penalty_state(1, len(logits_row)))
    return jax.tree.map(lambda a: np.asarray(a)[:num_draws], out)


def test_seeded_draws_repeat_and_depend_on_seed_and_step():
    logits = np.zeros(VOCAB, np.float32)  # uniform: any dependence on seed or step shows
    params = SamplingParams(temperature=1.0)
    first = draw(logits, params, 64, seeds=range(64), steps=[3] * 64)
    np.testing.assert_array_equal(first.token_ids, draw(logits, params, 64, seeds=range(64), steps=[3] * 64).token_ids)
    assert len(set(first.token_ids)) > 20  # different seeds draw differently
    later = draw(logits, params, 64, seeds=range(64), steps=[4] * 64)
    assert (later.token_ids != first.token_ids).mean() > 0.8  # so do different steps of the same seed
    big = draw(logits, params, 3, seeds=[2**32 - 1, -1, 2**32 + 5], steps=[0, 0, 0])
    assert big.token_ids[0] == big.token_ids[1]  # seeds are taken modulo 2**32
    assert big.token_ids[2] == draw(logits, params, 1, seeds=[5]).token_ids[0]


def test_a_rows_draw_does_not_depend_on_its_position_or_neighbours():
    logits = random_logits(40, scale=0.5, seed=4)  # fairly flat rows: draws vary a lot with the key
    targets = [(SamplingParams(temperature=1.5), 1000 + i, 7 + i) for i in range(8)]
    # batch A: the targets first, beside plain sampling rows (no sort, no penalties run)
    rows_a = [SamplingRow(p, seed, step, 0) for p, seed, step in targets]
    rows_a += [SamplingRow(SamplingParams(), 50 + i, 0, 1) for i in range(4)]
    # batch B: the targets reversed, at rows 5.., after neighbours that need the sort and the penalties
    neighbours = [SamplingParams(top_k=3), SamplingParams(temperature=0, repetition_penalty=2.0)]
    rows_b = [SamplingRow(neighbours[i % 2], i, 0, 2) for i in range(5)]
    rows_b += [SamplingRow(p, seed, step, 0) for p, seed, step in reversed(targets)]
    logits_a = np.concatenate([logits[:8], logits[20:24], logits[36:40]])  # 16 rows: the last 4 are padding
    logits_b = np.concatenate([logits[30:35], logits[:8][::-1], logits[36:39]])
    state = history_state()
    out_a = SAMPLE(logits_a, pack(rows_a, 16), state)
    out_b = SAMPLE(logits_b, pack(rows_b, 16), state)
    np.testing.assert_array_equal(np.asarray(out_a.token_ids)[:8], np.asarray(out_b.token_ids)[5:13][::-1])
    np.testing.assert_allclose(np.asarray(out_a.logprobs)[:8], np.asarray(out_b.logprobs)[5:13][::-1], rtol=1e-6)
    assert len(set(np.asarray(out_a.token_ids)[:8])) > 2  # the targets really are random draws


@pytest.mark.parametrize("name", ["top_k", "top_p", "min_p", "top_k and top_p", "everything", "suppressed"])
def test_draws_stay_inside_the_allowed_set(name):
    params, suppressed = OPTIONS[name]
    logits = random_logits(1, seed=5)[0]
    logits[list(suppressed)] += 10.0  # make the suppressed tokens the likeliest ones
    allowed = np.isfinite(reference_process(logits, params, suppressed))
    tokens = draw(logits, params, suppressed=suppressed).token_ids
    assert allowed[tokens].all()
    assert len(set(tokens)) > 1  # the set is not trivially a single token


def expected_frequencies(logits, params):
    return softmax(reference_process(logits, params))


@pytest.mark.parametrize(
    "params",
    [
        SamplingParams(temperature=1.0),
        SamplingParams(temperature=0.7),
        SamplingParams(temperature=1.3, top_k=4),
        SamplingParams(temperature=1.0, top_p=0.8),
        SamplingParams(temperature=1.0, min_p=0.2, logit_bias={5: 1.5}),
    ],
    ids=["t1", "t0.7", "top_k", "top_p", "min_p_bias"],
)
def test_draws_follow_the_reference_distribution(params):
    logits = np.log([0.32, 0.25, 0.18, 0.12, 0.08, 0.05]).astype(np.float32)
    # spread over seeds and steps, fixed so the test is deterministic
    tokens = draw(logits, params, seeds=range(10_000, 10_000 + DRAWS), steps=[i % 7 for i in range(DRAWS)]).token_ids
    freq = np.bincount(tokens, minlength=6) / DRAWS
    p = expected_frequencies(logits, params)
    stderr = np.sqrt(p * (1 - p) / DRAWS)
    assert (freq[p == 0] == 0).all()
    assert (np.abs(freq - p) <= 4 * stderr + 1e-12).all(), (freq, p)


def test_logprobs_are_the_raw_model_distribution():
    with_logprobs = (SamplingParams(temperature=0.3, logprobs=5), ())
    options = [OPTIONS["everything"], OPTIONS["bias"], with_logprobs]
    logits = random_logits(5, seed=6)
    rows, batch = rows_for(options)
    out = SAMPLE(logits, batch, history_state())
    raw = logits.astype(np.float64) - np.log(np.exp(logits.astype(np.float64)).sum(-1, keepdims=True))
    tokens = np.asarray(out.token_ids)
    np.testing.assert_allclose(out.logprobs, raw[np.arange(5), tokens], rtol=1e-5, atol=1e-5)
    order = np.argsort(-raw, axis=-1)[:, :MAX_LOGPROBS]
    np.testing.assert_array_equal(out.top_ids, order)
    np.testing.assert_allclose(out.top_logprobs, np.take_along_axis(raw, order, -1), rtol=1e-5, atol=1e-5)


def test_top_alternatives_are_skipped_when_no_row_wants_them():
    out = SAMPLE(random_logits(5, seed=7), rows_for([OPTIONS["bias"]] * 3)[1], history_state())
    assert (np.asarray(out.top_ids) == -1).all() and np.isneginf(out.top_logprobs).all()


def test_top_logprobs_past_a_tiny_vocabulary_are_padding():
    out = draw([3.0, 2.0, 1.0, 0.0, -1.0, -2.0], SamplingParams(logprobs=3), 2)
    assert out.top_ids.shape == (2, MAX_LOGPROBS) and out.top_logprobs.shape == (2, MAX_LOGPROBS)
    np.testing.assert_array_equal(out.top_ids[:, :6], [[0, 1, 2, 3, 4, 5]] * 2)
    assert (out.top_ids[:, 6:] == -1).all() and np.isneginf(out.top_logprobs[:, 6:]).all()


def test_suppressed_ids_are_never_drawn_even_when_by_far_the_likeliest():
    logits = np.zeros(6, np.float32)
    logits[[2, 4]] = 30.0
    for params in (SamplingParams(temperature=0), SamplingParams(temperature=5.0), SamplingParams(top_k=2)):
        tokens = draw(logits, params, suppressed=(2, 4)).token_ids
        assert not np.isin(tokens, [2, 4]).any()


def test_padding_rows_stay_finite_and_do_not_disturb_real_rows():
    logits = random_logits(4, seed=7)
    garbage = np.array([[0.0] * VOCAB, [1e30] * VOCAB, [-1e30] * VOCAB], np.float32)
    everything, suppressed = OPTIONS["everything"]
    rows, batch = rows_for([(dataclasses.replace(everything, logprobs=2), suppressed)], num_seqs_pad=3)
    state = history_state()
    out = SAMPLE(np.concatenate([logits[:1], garbage]), batch, state)
    alone = SAMPLE(logits[:1], pack(rows, 1), state)
    for field in ("token_ids", "top_ids"):
        assert ((0 <= getattr(out, field)[1:]) & (getattr(out, field)[1:] < VOCAB)).all()
    assert np.isfinite(np.asarray(out.logprobs)).all()
    assert not np.isnan(np.asarray(out.top_logprobs)).any()
    assert int(out.token_ids[0]) == int(alone.token_ids[0])


@pytest.mark.parametrize("params", [SamplingParams(temperature=1e-37), SamplingParams(temperature=1e-37, top_p=0.9)])
def test_tiny_temperatures_draw_the_argmax_without_overflow(params):
    logits = 20 * random_logits(1, seed=8)[0]  # / 1e-37 would overflow float32
    out = draw(logits, params, 20)
    assert (out.token_ids == np.argmax(logits)).all()
    _, batch = rows_for([(params, ())])
    processed = np.asarray(PROCESS(np.stack([logits] * 3), batch, history_state()))
    assert not np.isnan(processed).any() and not np.isposinf(processed).any()


def test_jit_traces_once_for_any_option_values():
    traces = []

    def step(logits, batch, state):
        traces.append(1)  # runs only while tracing
        return sample(logits, batch, state)

    jitted = jax.jit(step)
    logits = random_logits(8, seed=9)
    for options in ([(SamplingParams(temperature=0), ())], list(OPTIONS.values())[:6], list(OPTIONS.values())[6:12]):
        _, batch = rows_for(options, num_seqs_pad=8 - len(options))
        jitted(logits, batch, history_state())
    assert len(traces) == 1


def test_build_sampling_batch_packs_and_pads():
    p = SamplingParams(temperature=0.5, top_k=7, top_p=0.9, min_p=0.1, repetition_penalty=1.2, logit_bias={4: 2.0})
    rows = [SamplingRow(p, seed=-1, step=9, slot=3, suppressed_ids=(4, 11)), SamplingRow(SamplingParams(), 5, 0, 1)]
    batch = pack(rows, 4)
    assert batch.bias_ids.shape == batch.bias_values.shape == (4, BIAS_WIDTH)
    np.testing.assert_array_equal(batch.temperature, [0.5, 1.0, 0.0, 0.0])  # padding rows are greedy
    np.testing.assert_array_equal(batch.top_k, [7, 0, 0, 0])
    np.testing.assert_allclose(batch.top_p, [0.9, 1.0, 1.0, 1.0])
    np.testing.assert_array_equal(batch.seeds, [2**32 - 1, 5, 0, 0])
    assert batch.seeds.dtype == np.uint32 and batch.steps.dtype == batch.slots.dtype == np.int32
    np.testing.assert_array_equal(batch.steps[:2], [9, 0])
    np.testing.assert_array_equal(batch.slots[:2], [3, 1])
    assert dict(zip(batch.bias_ids[0][:2], batch.bias_values[0][:2], strict=True)) == {4: -np.inf, 11: -np.inf}
    assert (batch.bias_ids[0, 2:] == -1).all() and (batch.bias_ids[1:] == -1).all()
    with pytest.raises(ValueError, match="exceed the batch of 1"):
        pack(rows, 1)


def test_bias_entries_overflow_names_the_fields():
    p = SamplingParams(logit_bias=dict.fromkeys(range(300), 1.0))
    assert len(bias_entries(p, range(290, 320))) == BIAS_WIDTH
    with pytest.raises(ValueError, match="logit_bias and stop_token_ids"):
        bias_entries(p, range(290, 321))
