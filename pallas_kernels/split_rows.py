"""The GPU kernels' view of a ragged batch: rows of query tokens, and split-KV partials merged back.

A row is a run of consecutive query tokens of one sequence, described by ROW_FIELDS int32s: its first
token, its number of tokens, the first token's position, its sequence. Decode rows (one token) walk their
context in `splits` programs whose partial outputs are merged by their log-sum-exps.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl

MASK_VALUE = -1e30  # finite: rows with nothing to attend to give zeros, not NaNs
ROW_FIELDS = 4


def prefill_rows(starts, q_lens, first_pos, num_tokens: int, block_q: int) -> jax.Array:
    """[R, ROW_FIELDS] rows of up to block_q tokens over the chunks of two or more tokens (R is static)."""
    num_seqs = starts.shape[0]
    max_rows = num_tokens // block_q + min(num_seqs, num_tokens // 2)  # each chunk adds <= 1 partial row
    rows_per_seq = jnp.where(q_lens > 1, pl.cdiv(q_lens, block_q), 0)
    row_ends = jnp.cumsum(rows_per_seq)
    row = jnp.arange(max_rows)
    seq = jnp.minimum(jnp.searchsorted(row_ends, row, side="right"), num_seqs - 1)
    offset = (row - (row_ends[seq] - rows_per_seq[seq])) * block_q
    count = jnp.where(row < row_ends[-1], jnp.clip(q_lens[seq] - offset, 0, block_q), 0)
    return jnp.stack([starts[seq] + offset, count, first_pos[seq] + offset, seq], axis=1).astype(jnp.int32)


def merge_splits(partials: jax.Array, lse: jax.Array, axis: int) -> jax.Array:
    """Combine split-KV partials [..., splits, ..., D] (splits at `axis`) weighted by their log-sum-exps
    (partials' shape without D)."""
    weights = jnp.exp(lse - lse.max(axis=axis, keepdims=True))
    weights = jnp.where(lse > MASK_VALUE / 2, weights, 0.0)  # splits that saw nothing
    total = weights.sum(axis=axis)
    merged = (partials * weights[..., None]).sum(axis=axis)
    return merged / jnp.where(total > 0, total, 1.0)[..., None]
