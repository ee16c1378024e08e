"""Plain-JAX paged attention: the reference every kernel must match, and the attention used on CPU.

Each query token attends to the pages of its own sequence, causally (kv position <= its position),
optionally within a sliding window and with a logit soft-cap.

Work is split the way ragged kernels split it, so that keys are gathered once per group of queries
rather than once per query: sequences with one new token (decodes) form one group of single-query rows;
longer chunks (prefills) are cut into rows of QUERY_BLOCK consecutive queries of one sequence. Each row
gathers its sequence's pages a block at a time and keeps an online softmax, so memory stays at
O(rows x block) however long the contexts are, and a group with no work costs no gathers.
"""

from __future__ import annotations

from dataclasses import replace

import jax
import jax.numpy as jnp

from jserve.attention.kv_cache import KVPages
from jserve.attention.metadata import AttentionMetadata

# Finite, so fully masked rows (padding tokens) give zeros rather than NaNs.
MASK_VALUE = -1e30
QUERY_BLOCK = 16
PAGES_PER_BLOCK = 8  # pages a row gathers per step of its walk


def write_kv(pages: KVPages, k: jax.Array, v: jax.Array, slot_mapping: jax.Array) -> KVPages:
    """Scatter the step's new K/V [T, kv_heads, head_dim] into their slots; padding slots (< 0) are dropped."""
    num_pages, page_size, heads, dim = pages.k.shape
    num_slots = num_pages * page_size
    slots = jnp.where(slot_mapping < 0, num_slots, slot_mapping)  # out of range -> dropped
    if slots.shape[0] == 1:
        # XLA turns a one-index scatter into a dynamic-update-slice that first reads the row it replaces,
        # and then copies the whole layer's pages to update them: a lone decode's step copied the entire
        # KV cache. A second, dropped index keeps it a scatter, done in place.
        slots, k, v = jnp.append(slots, num_slots), jnp.concatenate([k, k]), jnp.concatenate([v, v])

    def scatter(cache, new):
        flat = cache.reshape(num_slots, heads, dim).at[slots].set(new.astype(cache.dtype), mode="drop")
        return flat.reshape(cache.shape)

    return replace(pages, k=scatter(pages.k, k), v=scatter(pages.v, v))


def paged_attention(
    q: jax.Array,
    pages: KVPages,
    meta: AttentionMetadata,
    *,
    scale: float,
    sliding_window: int | None = None,
    soft_cap: float | None = None,
    pages_per_block: int = PAGES_PER_BLOCK,
) -> jax.Array:
    """q [T, heads, head_dim] -> attention output [T, heads, head_dim] over the (already written) pages."""
    num_tokens = q.shape[0]
    num_seqs = meta.page_tables.shape[0]
    starts = meta.query_start_loc[:-1]
    q_lens = meta.query_start_loc[1:] - starts

    # Decode rows: one per sequence, its single query (or nothing).
    decode_tokens = jnp.where(q_lens == 1, starts, num_tokens)[:, None]  # [S, 1]; num_tokens = no query
    decode_seqs = jnp.arange(num_seqs)

    # Prefill rows: chunks of two or more queries, QUERY_BLOCK at a time.
    max_rows = _max_prefill_rows(num_tokens, num_seqs)
    rows_per_seq = jnp.where(q_lens > 1, -(-q_lens // QUERY_BLOCK), 0)
    row_ends = jnp.cumsum(rows_per_seq)
    row = jnp.arange(max_rows)
    prefill_seqs = jnp.minimum(jnp.searchsorted(row_ends, row, side="right"), num_seqs - 1)
    first = starts[prefill_seqs] + (row - (row_ends[prefill_seqs] - rows_per_seq[prefill_seqs])) * QUERY_BLOCK
    prefill_tokens = first[:, None] + jnp.arange(QUERY_BLOCK)[None, :]
    in_chunk = (prefill_tokens < meta.query_start_loc[prefill_seqs + 1][:, None]) & (row < row_ends[-1])[:, None]
    prefill_tokens = jnp.where(in_chunk, prefill_tokens, num_tokens)

    def add_group(out, tokens, seqs):
        rows_out = _attend_rows(q, pages, meta, tokens, seqs, scale, sliding_window, soft_cap, pages_per_block)
        return out.at[tokens.reshape(-1)].set(rows_out.reshape(-1, *q.shape[1:]), mode="drop")

    out = jnp.zeros(q.shape, jnp.float32)
    groups = [(decode_tokens, decode_seqs)] + [(prefill_tokens, prefill_seqs)] * (max_rows > 0)  # 1-token steps: none
    for tokens, seqs in groups:
        # A group with no queries this step (no decodes, or no prefill chunks) costs nothing.
        out = jax.lax.cond((tokens < num_tokens).any(), add_group, lambda out, *_: out, out, tokens, seqs)
    return out.astype(q.dtype)


def _max_prefill_rows(num_tokens: int, num_seqs: int) -> int:
    return num_tokens // QUERY_BLOCK + min(num_seqs, num_tokens // 2)  # each chunk adds <= 1 partial row


def workspace_bytes(num_tokens: int, num_seqs: int, *, heads: int, kv_heads: int, head_dim: int, page_size: int) -> int:
    """An upper bound on the bytes of one call's float32 work arrays, both row groups at once: per row, a
    block's gathered K and V, its scores, probabilities and mask, the scaled queries and the accumulator."""
    keys = PAGES_PER_BLOCK * page_size

    def group(rows: int, queries: int) -> int:
        return rows * (2 * keys * kv_heads * head_dim + 3 * queries * heads * keys + 2 * queries * heads * head_dim)

    return 4 * (group(num_seqs, 1) + group(_max_prefill_rows(num_tokens, num_seqs), QUERY_BLOCK))


def _attend_rows(q, pages, meta, tokens, seqs, scale, sliding_window, soft_cap, pages_per_block):
    """Attention for rows of queries [R, Qb] (token indices, num_tokens = none), each row of sequence seqs[r]."""
    num_tokens, num_heads, head_dim = q.shape
    page_size, num_kv_heads = pages.k.shape[1], pages.k.shape[2]
    group = num_heads // num_kv_heads
    num_rows, row_len = tokens.shape
    max_pages = meta.page_tables.shape[1]
    pages_per_block = min(pages_per_block, max_pages)
    block_len = pages_per_block * page_size

    valid = tokens < num_tokens
    safe = jnp.where(valid, tokens, 0)
    query_pos = jnp.where(valid, meta.positions[safe], -1)  # [R, Qb]; -1 attends to nothing
    kv_lens = jnp.where(valid.any(axis=1), meta.context_lens[seqs], 0)  # [R]
    padded_pages = -(-max_pages // pages_per_block) * pages_per_block
    tables = jnp.pad(meta.page_tables, ((0, 0), (0, padded_pages - max_pages)))[seqs]  # [R, padded_pages]
    num_blocks = jnp.minimum(-(-jnp.max(kv_lens) // block_len), padded_pages // pages_per_block)

    # [R, kv_heads, Qb * group, head_dim]: one matmul per (row, kv head) covers all its queries and heads.
    qg = (q[safe].astype(jnp.float32) * scale).reshape(num_rows, row_len, num_kv_heads, group, head_dim)
    qg = qg.transpose(0, 2, 1, 3, 4).reshape(num_rows, num_kv_heads, row_len * group, head_dim)

    def visit_block(block, carry):
        running_max, denom, acc = carry
        block_pages = jax.lax.dynamic_slice_in_dim(tables, block * pages_per_block, pages_per_block, axis=1)
        k = pages.k[block_pages].reshape(num_rows, block_len, num_kv_heads, head_dim).astype(jnp.float32)
        v = pages.v[block_pages].reshape(num_rows, block_len, num_kv_heads, head_dim).astype(jnp.float32)
        kv_pos = block * block_len + jnp.arange(block_len)
        mask = (kv_pos[None, None, :] <= query_pos[:, :, None]) & (kv_pos[None, None, :] < kv_lens[:, None, None])
        if sliding_window is not None:
            mask &= kv_pos[None, None, :] > query_pos[:, :, None] - sliding_window
        scores = jnp.einsum("rhmd,rkhd->rhmk", qg, k).reshape(num_rows, num_kv_heads, row_len, group, block_len)
        if soft_cap is not None:
            scores = soft_cap * jnp.tanh(scores / soft_cap)
        mask = mask[:, None, :, None, :]
        scores = jnp.where(mask, scores, MASK_VALUE)
        new_max = jnp.maximum(running_max, scores.max(axis=-1))
        probs = jnp.where(mask, jnp.exp(scores - new_max[..., None]), 0.0)
        correction = jnp.exp(running_max - new_max)
        denom = denom * correction + probs.sum(axis=-1)
        flat_probs = probs.reshape(num_rows, num_kv_heads, row_len * group, block_len)
        update = jnp.einsum("rhmk,rkhd->rhmd", flat_probs, v).reshape(*shape, head_dim)
        acc = acc * correction[..., None] + update
        return new_max, denom, acc

    shape = (num_rows, num_kv_heads, row_len, group)
    init = (
        jnp.full(shape, MASK_VALUE, jnp.float32),
        jnp.zeros(shape, jnp.float32),
        jnp.zeros((*shape, head_dim), jnp.float32),
    )
    _, denom, acc = jax.lax.fori_loop(0, num_blocks, visit_block, init)
    out = acc / jnp.where(denom > 0, denom, 1.0)[..., None]
    return out.transpose(0, 2, 1, 3, 4)  # [R, Qb, kv_heads, group, head_dim]
