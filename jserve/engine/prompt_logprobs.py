"""Prompt logprobs on device: each scored prompt token's log-probability under the model, its rank, and the
model's top alternatives at that position.

The step's hidden states are run through the LM head block by block (SCORE_BLOCK positions at a time, so the
[positions, vocab] logits never exist whole), only when some position of the step is scored (a stage of the
step, see stages.py): other steps pay nothing; the outputs have fixed shapes.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import jax
import jax.numpy as jnp

from jserve.engine.stages import Gate, gated
from jserve.sampling_params import MAX_LOGPROBS

SCORE_BLOCK = 128  # positions per block of the LM head


@jax.tree_util.register_dataclass
@dataclass(frozen=True)
class PromptScores:
    """Per position of the step (leading dim T); meaningful where the position was scored."""

    logprob: jax.Array  # [T] f32: log p(target | tokens up to the position)
    rank: jax.Array  # [T] i32: 1 + the tokens more likely than the target
    top_ids: jax.Array  # [T, MAX_LOGPROBS] i32, most likely first; -1 past the vocabulary
    top_logprobs: jax.Array  # [T, MAX_LOGPROBS] f32


def score_positions(
    head: Callable[[jax.Array], jax.Array], hidden: jax.Array, targets: jax.Array, gate: Gate = Gate.WHEN_NEEDED
) -> PromptScores:
    """Scores of `targets` [T] (-1: not scored) given the final hidden states [T, H]; head gives f32 logits.
    `gate`: whether to score at all (see stages.py); unscored positions' scores are meaningless."""
    num = hidden.shape[0]

    def scored() -> PromptScores:
        block = min(SCORE_BLOCK, num)  # token buckets are powers of two, so this divides num

        def score_block(args):
            h, t = args
            logprobs = jax.nn.log_softmax(head(h), axis=-1)
            chosen = jnp.take_along_axis(logprobs, jnp.maximum(t, 0)[:, None], axis=-1)[:, 0]
            rank = 1 + jnp.sum(logprobs > chosen[:, None], axis=-1, dtype=jnp.int32)
            k = min(MAX_LOGPROBS, logprobs.shape[-1])
            top_logprobs, top_ids = jax.lax.top_k(logprobs, k)
            pad = ((0, 0), (0, MAX_LOGPROBS - k))  # a vocabulary smaller than MAX_LOGPROBS (tiny test models)
            top_ids = jnp.pad(top_ids.astype(jnp.int32), pad, constant_values=-1)
            top_logprobs = jnp.pad(top_logprobs, pad, constant_values=-jnp.inf)
            return chosen, rank, top_ids, top_logprobs

        blocks = (hidden.reshape(num // block, block, -1), targets.reshape(num // block, block))
        out = jax.lax.map(score_block, blocks)
        return PromptScores(*(x.reshape(num, *x.shape[2:]) for x in out))

    return gated(gate, lambda: jnp.any(targets >= 0), scored, lambda: no_scores(num))


def no_scores(num: int) -> PromptScores:
    return PromptScores(
        logprob=jnp.zeros(num, jnp.float32),
        rank=jnp.zeros(num, jnp.int32),
        top_ids=jnp.full((num, MAX_LOGPROBS), -1, jnp.int32),
        top_logprobs=jnp.full((num, MAX_LOGPROBS), -jnp.inf, jnp.float32),
    )
