"""The GPU kernels' view of a ragged batch: rows of query tokens, and split-KV partials merged back.

A row is a run of consecutive query tokens of one sequence, described by ROW_FIELDS int32s: its first
token, its number of tokens, the first token's position, its sequence. Decode rows (one token) walk their
context in `splits` programs whose partial outputs are merged by their log-sum-exps; how many is chosen per
step bucket from its sequence slots (`decode_splits`), so a lone decode still fills the GPU and a full batch
pays no merge.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl

MASK_VALUE = -1e30  # finite: rows with nothing to attend to give zeros, not NaNs
ROW_FIELDS = 4
# The SMs of the GPU a kernel is lowered for when none says otherwise (a host without one): an H100's.
DEFAULT_NUM_CORES = 132
# Decode programs (sequence slots x KV heads x splits) per SM to aim for: a second resident program keeps
# K/V loads in flight while the first waits on its own. (Not yet tuned on hardware.)
PROGRAMS_PER_CORE = 2
# At most this many splits: a lone decode of a 128k context is 2048 blocks of 64 keys, 64 blocks per split.
MAX_KV_SPLITS = 32


def default_pages_per_block(page_size: int) -> int:
    return max(1, 64 // page_size)  # 64-key K/V blocks


def sequence_spans(context_lens, query_start_loc) -> tuple[jax.Array, jax.Array, jax.Array]:
    """Each sequence's first query token, number of query tokens and first query position (int32 [S])."""
    starts = query_start_loc[:-1].astype(jnp.int32)
    q_lens = query_start_loc[1:].astype(jnp.int32) - starts
    return starts, q_lens, context_lens.astype(jnp.int32) - q_lens


def decode_splits(num_seqs: int, kv_heads: int, num_cores: int, programs_per_core: int = PROGRAMS_PER_CORE) -> int:
    """Splits of each decode's context for a step of num_seqs sequence slots: enough for `programs_per_core`
    decode programs (slots x KV heads x splits) per SM, and one when the slots alone give that many."""
    return max(1, min(MAX_KV_SPLITS, pl.cdiv(programs_per_core * num_cores, num_seqs * kv_heads)))


def split_tables(page_tables, pages_per_block: int, kv_splits: int) -> tuple[jax.Array, int, int]:
    """-> (page tables padded so every K/V block of every split reads inside them, kv_splits, blocks per split).
    A decode's context of `pages_per_block`-page blocks is cut into `kv_splits` runs (fewer if it has fewer
    blocks)."""
    num_seqs, max_pages = page_tables.shape
    num_blocks = pl.cdiv(max_pages, pages_per_block)
    kv_splits = max(1, min(kv_splits, num_blocks))
    blocks_per_split = pl.cdiv(num_blocks, kv_splits)
    padded_pages = kv_splits * blocks_per_split * pages_per_block  # page 0 stands in past the end; it is masked
    tables = jnp.pad(page_tables.astype(jnp.int32), ((0, 0), (0, padded_pages - max_pages)))
    return tables, kv_splits, blocks_per_split


def decode_rows(starts, q_lens, first_pos) -> jax.Array:
    """[S, ROW_FIELDS]: a row per sequence slot, of its one token when it decodes, else empty."""
    seqs = jnp.arange(starts.shape[0], dtype=jnp.int32)
    return jnp.stack([starts, (q_lens == 1).astype(jnp.int32), first_pos, seqs], axis=1)


def prefill_rows(starts, q_lens, first_pos, num_tokens: int, block_q: int) -> jax.Array:
    """[R, ROW_FIELDS] rows of up to block_q tokens over the chunks of two or more tokens (R is static)."""
    num_seqs = starts.shape[0]
    max_rows = num_tokens // block_q + min(num_seqs, num_tokens // 2)  # each chunk adds <= 1 partial row
    rows_per_seq = jnp.where(q_lens > 1, pl.cdiv(q_lens, block_q), 0)
    row_ends = jnp.cumsum(rows_per_seq)
    row = jnp.arange(max_rows)
    # compare_all: one elementwise kernel ([R, S] compares), where the default binary search is a loop that
    # XLA:GPU runs from the host, outside the step's CUDA graph.
    seq = jnp.minimum(jnp.searchsorted(row_ends, row, side="right", method="compare_all"), num_seqs - 1)
    offset = (row - (row_ends[seq] - rows_per_seq[seq])) * block_q
    count = jnp.where(row < row_ends[-1], jnp.clip(q_lens[seq] - offset, 0, block_q), 0)
    return jnp.stack([starts[seq] + offset, count, first_pos[seq] + offset, seq], axis=1).astype(jnp.int32)


def merge_splits(partials: jax.Array, lse: jax.Array, axis: int) -> jax.Array:
    """Combine split-KV partials [..., splits, ..., D] (splits at `axis`) weighted by their log-sum-exps
    (partials' shape without D).

    The maximum and the weights' total run over the (at most MAX_KV_SPLITS) splits as chains of elementwise
    operations: as reductions over the split axis, XLA:GPU gave each a kernel of its own; this way the total
    fuses into the weighted sum's kernel (two kernels, not three, after a lone decode's split programs)."""

    def over_splits(op, x: jax.Array) -> jax.Array:
        return functools.reduce(op, [jax.lax.index_in_dim(x, i, axis) for i in range(x.shape[axis])])

    weights = jnp.exp(lse - over_splits(jnp.maximum, lse))
    weights = jnp.where(lse > MASK_VALUE / 2, weights, 0.0)  # splits that saw nothing
    total = over_splits(jnp.add, weights)
    merged = (partials * weights[..., None]).sum(axis=axis, keepdims=True)
    return jnp.squeeze(merged / jnp.where(total > 0, total, 1.0)[..., None], axis)
