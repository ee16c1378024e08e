"""Per-sequence sampling on device, inside the engine's jitted step.

For a padded batch of S sequences the sampler applies, row by row with each row's own options:
a grammar's token bitmask (structured outputs) → logit_bias → repetition penalty → presence/frequency
penalties, then either argmax (temperature 0) or temperature → top-k → top-p → min-p → a seeded
Gumbel-max draw. Rows never read one another, so a request's tokens do not depend on its row or its
neighbours; the only batch-wide decisions are whether to apply bitmasks, biases and penalties, the
top-k/top-p sort, the random draw and the logprobs at all: each a stage that the step's StepStages gate
(stages.py), skipped when no row needs it, which on CPU saves most of the cost of plain greedy or plain
temperature batches.
top-k/top-p look at each row's best TOP_HEAD tokens (`lax.top_k`) and sort whole rows only when those do
not decide a row (k > TOP_HEAD, or a flat distribution whose head holds less than top_p).

Ties: top-k and top-p become a threshold logit, and every token equal to the threshold is kept, so a
tie at the boundary can keep more than k tokens; min-p keeps tokens with exactly min_p * max_prob.

The penalties and the PenaltyState they read live in penalties.py; this module re-exports them, so the
engine's step needs only `jserve.engine.sampler`.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from functools import partial

import jax
import jax.numpy as jnp
import numpy as np

from jserve.engine.penalties import PenaltyState, apply_penalties, init_penalty_state, update_penalty_state
from jserve.engine.stages import DEVICE_DECIDES, Gate, StepStages, filtered_rows, gated, penalised_rows, top_k_rows
from jserve.errors import RequestError
from jserve.sampling_params import MAX_LOGIT_BIAS, MAX_LOGPROBS, SamplingParams

__all__ = [
    "BIAS_WIDTH",
    "MIN_TEMPERATURE",
    "TOP_HEAD",
    "PenaltyState",
    "SamplerOutput",
    "SamplingBatch",
    "bias_entries",
    "full_bitmask",
    "init_penalty_state",
    "no_samples",
    "process_logits",
    "sample",
    "update_penalty_state",
]

# Bias entries per row: a request's logit_bias plus room for the ids suppressed while min_tokens is unmet.
BIAS_WIDTH = MAX_LOGIT_BIAS + 20
# top-k/top-p first look at this many best tokens of each row, and sort whole rows only if that is too few.
TOP_HEAD = 1024
# The greedy argmax scans rows in blocks of at most this many tokens (see _argmax).
ARGMAX_BLOCK = 1024
# Positive temperatures below this act as it: logits / 1e-40 would overflow to inf and softmax to NaN.
MIN_TEMPERATURE = 1e-5


@jax.tree_util.register_dataclass
@dataclass(frozen=True)
class SamplingBatch:
    """Each row's sampling options, leading dim S (numpy on the host, jax arrays in the step)."""

    temperature: jax.Array  # [S] f32, 0 = greedy
    top_k: jax.Array  # [S] i32, 0 (or >= vocab) = off
    top_p: jax.Array  # [S] f32, 1 = off
    min_p: jax.Array  # [S] f32, 0 = off
    repetition_penalty: jax.Array  # [S] f32, 1 = off
    presence_penalty: jax.Array  # [S] f32
    frequency_penalty: jax.Array  # [S] f32
    seeds: jax.Array  # [S] u32
    steps: jax.Array  # [S] i32: tokens generated so far; the row's key is fold_in(key(seed), step)
    slots: jax.Array  # [S] i32: the PenaltyState row of the sequence
    bias_ids: jax.Array  # [S, BIAS_WIDTH] i32, -1 = unused entry
    bias_values: jax.Array  # [S, BIAS_WIDTH] f32, added to the logit; -inf forbids the token
    wants_top_logprobs: jax.Array  # [S] bool: the request asked for logprobs (its token's and the top ones)
    token_bitmask: jax.Array  # [S, ceil(V / 32)] i32: bit v % 32 of word v // 32 set = token v allowed
    constrained: jax.Array  # [S] bool: the row has a grammar (its bitmask is not all ones)


# What a padding row of a SamplingBatch holds: greedy, every option off, no bias (its bitmask is all ones).
PADDING = {"temperature": 0.0, "top_k": 0, "top_p": 1.0, "min_p": 0.0, "repetition_penalty": 1.0,
           "presence_penalty": 0.0, "frequency_penalty": 0.0, "seeds": 0, "steps": 0, "slots": 0, "bias_ids": -1,
           "bias_values": 0.0, "wants_top_logprobs": False, "constrained": False}  # fmt: skip


@jax.tree_util.register_dataclass
@dataclass(frozen=True)
class SamplerOutput:
    token_ids: jax.Array  # [S] i32
    logprobs: jax.Array  # [S] f32: the chosen token's log-prob under the raw model distribution (0 if unasked)
    top_ids: jax.Array  # [S, MAX_LOGPROBS] i32: most likely tokens, descending; -1 past the vocabulary
    top_logprobs: jax.Array  # [S, MAX_LOGPROBS] f32: their raw log-probs; -inf past the vocabulary
    # (all three are computed only when some row wants logprobs; otherwise 0 / -1 / -inf)


def process_logits(
    logits: jax.Array, batch: SamplingBatch, state: PenaltyState, stages: StepStages = DEVICE_DECIDES
) -> jax.Array:
    """[S, V] logits as the draw sees them: biased and penalised; then for sampling rows also divided by
    the temperature and filtered by top-k, top-p and min-p (filtered-out tokens -inf)."""
    logits = _penalised(logits, batch, state, stages.adjust)
    greedy = batch.temperature == 0
    temperature = jnp.where(greedy, 1.0, jnp.maximum(batch.temperature, MIN_TEMPERATURE))
    scaled = logits / temperature[:, None]
    return jnp.where(greedy[:, None], logits, _filter(scaled, batch, stages.filters))


def sample(
    logits: jax.Array, batch: SamplingBatch, state: PenaltyState, stages: StepStages = DEVICE_DECIDES
) -> SamplerOutput:
    """One token per row: argmax of the processed logits for greedy rows, a seeded draw for the rest."""
    greedy = batch.temperature == 0

    def draw() -> jax.Array:
        # argmax(logits + Gumbel noise) is a draw from softmax(logits); -inf entries stay -inf.
        keys = jax.vmap(lambda seed, step: jax.random.fold_in(jax.random.key(seed), step))(batch.seeds, batch.steps)
        noise = jax.vmap(lambda key: jax.random.gumbel(key, logits.shape[-1:]))(keys)
        return _argmax(process_logits(logits, batch, state, stages) + jnp.where(greedy[:, None], 0.0, noise))

    def pick_greedy() -> jax.Array:
        # Greedy rows see only the bias and penalties: the [S, V] passes of the filters and the noise are
        # skipped at run time when every row is greedy (the common case when serving), and so is the copy
        # of the logits that a bias or penalty is written into when no row has either.
        def adjusted() -> jax.Array:
            return jnp.any(batch.bias_ids >= 0) | jnp.any(penalised_rows(batch)) | jnp.any(batch.constrained)

        def penalised() -> jax.Array:
            return _argmax(_penalised(logits, batch, state, stages.adjust))

        return gated(stages.adjust, adjusted, penalised, lambda: _argmax(logits))

    # (a draw leaves greedy rows their argmax: it can run for a batch of greedy rows)
    token_ids = gated(stages.draw, lambda: jnp.any(~greedy), draw, pick_greedy)

    def with_logprobs() -> tuple[jax.Array, jax.Array, jax.Array]:
        raw = jax.nn.log_softmax(jnp.asarray(logits, jnp.float32), axis=-1)
        top_logprobs, top_ids = jax.lax.top_k(raw, min(MAX_LOGPROBS, raw.shape[-1]))
        missing = MAX_LOGPROBS - top_ids.shape[-1]  # a vocabulary smaller than MAX_LOGPROBS (tiny test models)
        return (
            jnp.take_along_axis(raw, token_ids[:, None], axis=-1)[:, 0],
            jnp.pad(top_ids.astype(jnp.int32), ((0, 0), (0, missing)), constant_values=-1),
            jnp.pad(top_logprobs, ((0, 0), (0, missing)), constant_values=-jnp.inf),
        )

    def without() -> tuple[jax.Array, jax.Array, jax.Array]:
        empty = no_samples(logits.shape[0])
        return empty.logprobs, empty.top_ids, empty.top_logprobs

    # A log-softmax and top-k over the whole vocabulary cost real time on CPU: only when some row asked.
    wanted = batch.wants_top_logprobs
    chosen, top_ids, top_logprobs = gated(stages.logprobs, lambda: jnp.any(wanted), with_logprobs, without)
    return SamplerOutput(token_ids=token_ids, logprobs=chosen, top_ids=top_ids, top_logprobs=top_logprobs)


# A packed sample row (pack_samples): token id, logprob, MAX_LOGPROBS top ids, MAX_LOGPROBS top logprobs.
TOP_IDS, TOP_LOGPROBS = slice(2, 2 + MAX_LOGPROBS), slice(2 + MAX_LOGPROBS, 2 + 2 * MAX_LOGPROBS)


def pack_samples(out: SamplerOutput) -> jax.Array:
    """[S, 2 + 2 * MAX_LOGPROBS] int32, the float columns bit for bit: one array for a step to return and the host to
    fetch instead of four (each costs host time on both ends). The host reads it as FetchedSamples."""
    bits = partial(jax.lax.bitcast_convert_type, new_dtype=jnp.int32)
    columns = (out.token_ids[:, None], bits(out.logprobs)[:, None], out.top_ids, bits(out.top_logprobs))
    return jnp.concatenate(columns, axis=1)


def no_samples(rows: int) -> SamplerOutput:
    """The output of `rows` rows that sampled nothing and were asked for no logprobs."""
    return SamplerOutput(
        token_ids=jnp.zeros((rows,), jnp.int32),
        logprobs=jnp.zeros((rows,), jnp.float32),
        top_ids=jnp.full((rows, MAX_LOGPROBS), -1, jnp.int32),
        top_logprobs=jnp.full((rows, MAX_LOGPROBS), -jnp.inf, jnp.float32),
    )


def _penalised(logits: jax.Array, batch: SamplingBatch, state: PenaltyState, gate: Gate) -> jax.Array:
    """Bitmasks, biases and penalties applied (`gate` RUN: to every row; the bitmasks of rows without a
    grammar are all ones and their penalties neutral, so those rows come out as they went in)."""
    raw = jnp.asarray(logits, jnp.float32)
    masked = gated(
        gate, lambda: jnp.any(batch.constrained), lambda: _apply_bitmask(raw, batch.token_bitmask), lambda: raw
    )
    return apply_penalties(
        _apply_bias(masked, batch),
        state,
        batch.slots,
        batch.repetition_penalty,
        batch.presence_penalty,
        batch.frequency_penalty,
        gate,
    )


def _argmax(x: jax.Array) -> jax.Array:
    """jnp.argmax of each row (the first maximum, or the first NaN); on a CPU in two steps: the maximum of each
    block of the row, then the best block's own argmax. XLA:CPU runs a whole-row argmax as a scalar (value,
    index) reduction, ~15x slower than the blocks' vectorised maximum for SmolLM2's vocabulary."""
    rows, vocab = x.shape
    block = max(d for d in range(1, min(vocab, ARGMAX_BLOCK) + 1) if vocab % d == 0)

    def by_blocks() -> jax.Array:
        blocks = x.reshape(rows, vocab // block, block)
        best = jnp.argmax(blocks.max(axis=-1), axis=-1)
        within = jnp.argmax(jnp.take_along_axis(blocks, best[:, None, None], axis=1)[:, 0], axis=-1)
        return (best * block + within).astype(jnp.int32)

    def whole_rows() -> jax.Array:
        return jnp.argmax(x, axis=-1).astype(jnp.int32)

    def on_cpu() -> jax.Array:
        # The vectorised maximum may skip NaN; a NaN anywhere (seen in the sum) takes the exact path.
        return jax.lax.cond(jnp.isnan(jnp.sum(x)), whole_rows, by_blocks)

    if block < 64:  # a vocabulary with no useful divisor
        return whole_rows()
    return jax.lax.platform_dependent(cpu=on_cpu, default=whole_rows)


def _apply_bitmask(logits: jax.Array, bitmask: jax.Array) -> jax.Array:
    """-inf where the row's bitmask clears the token's bit."""
    rows, vocab = logits.shape
    bits = (bitmask[:, :, None] >> jnp.arange(32, dtype=jnp.int32)) & 1
    allowed = bits.reshape(rows, -1)[:, :vocab].astype(bool)
    return jnp.where(allowed, logits, -jnp.inf)


def _apply_bias(logits: jax.Array, batch: SamplingBatch) -> jax.Array:
    rows = jnp.arange(logits.shape[0])[:, None]
    # Unused (-1) entries point one past the vocabulary, where the scatter drops them; repeated ids add up.
    ids = jnp.where(batch.bias_ids >= 0, batch.bias_ids, logits.shape[-1])
    return logits.at[rows, ids].add(batch.bias_values, mode="drop")


def _filter(scaled: jax.Array, batch: SamplingBatch, gate: Gate) -> jax.Array:
    """Keeps the tokens that pass top-k, top-p and min-p (as thresholds on the scaled logits)."""
    vocab = scaled.shape[-1]
    top_k_on, needed = top_k_rows(batch, vocab), filtered_rows(batch, vocab)

    def top_k_top_p() -> jax.Array:
        # The best TOP_HEAD tokens usually decide both; whole rows are sorted only when they do not.
        # (The barrier stops XLA's CPU compiler from rewriting this TopK, once sliced, into a full sort.)
        head = jax.lax.optimization_barrier(jax.lax.top_k(scaled, min(TOP_HEAD, vocab))[0])
        threshold, decided = _top_k_top_p_threshold(head, scaled, batch, top_k_on)

        def from_whole_rows() -> jax.Array:
            return _top_k_top_p_threshold(_sort_descending(scaled), scaled, batch, top_k_on)[0]

        # (a device conditional, on a GPU too: sorting whole rows every step would cost more than its wait)
        return jax.lax.cond(jnp.all(decided | ~needed), lambda: threshold, from_whole_rows)

    threshold = gated(gate, lambda: jnp.any(needed), top_k_top_p, lambda: jnp.full(scaled.shape[:1], -jnp.inf))
    # p_i >= min_p * p_max  <=>  logit_i >= logit_max + log(min_p); log(0) = -inf keeps everything
    threshold = jnp.maximum(threshold, scaled.max(axis=-1) + jnp.log(batch.min_p))
    return jnp.where(scaled >= threshold[:, None], scaled, -jnp.inf)


def _top_k_top_p_threshold(
    descending: jax.Array, scaled: jax.Array, batch: SamplingBatch, top_k_on: jax.Array
) -> tuple[jax.Array, jax.Array]:
    """From the best tokens of each row, descending [S, W <= V]: the lowest logit that top-k and then top-p
    keep (-inf where both are off), and whether those W tokens were enough to tell."""
    width = descending.shape[-1]
    kth = jnp.take_along_axis(descending, (jnp.clip(batch.top_k, 1, width) - 1)[:, None], axis=-1)[:, 0]
    kth = jnp.where(top_k_on, kth, -jnp.inf)
    # top-p renormalises over the tokens top-k keeps, so their total comes from the whole row. The tokens
    # past them need no masking: they come later in descending order, where the mass above is already ~1.
    peak = descending[:, :1]
    total = jnp.sum(jnp.where(scaled >= kth[:, None], jnp.exp(scaled - peak), 0.0), axis=-1, keepdims=True)
    probs = jnp.exp(descending - peak) / total
    cumulative = jnp.cumsum(probs, axis=-1)
    # keep each token whose better-ranked tokens hold less than top_p: the smallest prefix reaching
    # top_p, and always the top token
    kept = jnp.where(cumulative - probs < batch.top_p[:, None], descending, jnp.inf)
    top_p_on = batch.top_p < 1
    threshold = jnp.maximum(kth, jnp.where(top_p_on, kept.min(axis=-1), -jnp.inf))
    decided = (~top_k_on | (batch.top_k <= width)) & (~top_p_on | (cumulative[:, -1] >= batch.top_p))
    return threshold, decided


def _sort_descending(x: jax.Array) -> jax.Array:
    # XLA's CPU sort compares floats in a NaN-aware total order, about 4x slower than sorting their bit
    # patterns as ints; flipping the magnitude bits of negative floats makes the int order the float order.
    bits = jax.lax.bitcast_convert_type(x, jnp.int32)
    keys = jnp.sort(bits ^ ((bits >> 31) & 0x7FFFFFFF), axis=-1)[:, ::-1]
    return jax.lax.bitcast_convert_type(keys ^ ((keys >> 31) & 0x7FFFFFFF), jnp.float32)


def bias_entries(params: SamplingParams, suppressed_ids: Sequence[int] = ()) -> dict[int, float]:
    """The row's logit bias: the request's, with suppressed ids set to -inf; at most BIAS_WIDTH entries.

    The engine can call it on admission with every id it may suppress, to reject a request that won't fit.
    """
    entries = {**params.logit_bias, **dict.fromkeys(suppressed_ids, -np.inf)}
    if len(entries) > BIAS_WIDTH:
        raise RequestError(
            f"logit_bias and stop_token_ids together may name at most {BIAS_WIDTH} tokens, got {len(entries)}",
            "logit_bias",
        )
    return entries


def full_bitmask(num_seqs: int, vocab_size: int) -> np.ndarray:
    """A token bitmask that allows every token in every row."""
    return np.full((num_seqs, (vocab_size + 31) // 32), -1, np.int32)
