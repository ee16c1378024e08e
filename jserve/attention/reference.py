"""Plain-JAX paged attention: the reference every kernel must match, and the attention used on CPU.

Each query token attends to the pages of its own sequence, causally (kv position <= its position),
optionally within a sliding window and with a logit soft-cap. Keys are visited a block of pages at a
time with an online softmax, so memory stays at O(tokens x block) however long the contexts are.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from jserve.attention.kv_cache import KVPages
from jserve.attention.metadata import AttentionMetadata

# Finite, so fully masked rows (padding tokens) give zeros rather than NaNs.
MASK_VALUE = -1e30


def write_kv(pages: KVPages, k: jax.Array, v: jax.Array, slot_mapping: jax.Array) -> KVPages:
    """Scatter the step's new K/V [T, kv_heads, head_dim] into their slots; padding slots (< 0) are dropped."""
    num_pages, page_size, heads, dim = pages.k.shape
    num_slots = num_pages * page_size
    slots = jnp.where(slot_mapping < 0, num_slots, slot_mapping)  # out of range -> dropped

    def scatter(cache, new):
        flat = cache.reshape(num_slots, heads, dim).at[slots].set(new.astype(cache.dtype), mode="drop")
        return flat.reshape(cache.shape)

    return KVPages(scatter(pages.k, k), scatter(pages.v, v))


def paged_attention(
    q: jax.Array,
    pages: KVPages,
    meta: AttentionMetadata,
    *,
    scale: float,
    sliding_window: int | None = None,
    soft_cap: float | None = None,
    pages_per_block: int = 8,
) -> jax.Array:
    """q [T, heads, head_dim] -> attention output [T, heads, head_dim] over the (already written) pages."""
    num_tokens, num_heads, head_dim = q.shape
    page_size, num_kv_heads = pages.k.shape[1], pages.k.shape[2]
    group = num_heads // num_kv_heads
    num_seqs, max_pages = meta.page_tables.shape
    pages_per_block = min(pages_per_block, max_pages)
    block_len = pages_per_block * page_size

    token_idx = jnp.arange(num_tokens)
    seq_ids = jnp.minimum(jnp.searchsorted(meta.query_start_loc[1:], token_idx, side="right"), num_seqs - 1)
    is_query = token_idx < meta.query_start_loc[-1]
    kv_lens = jnp.where(is_query, meta.context_lens[seq_ids], 0)
    query_pos = meta.positions

    padded_pages = -(-max_pages // pages_per_block) * pages_per_block
    tables = jnp.pad(meta.page_tables, ((0, 0), (0, padded_pages - max_pages)))[seq_ids]  # [T, padded_pages]
    num_blocks = jnp.minimum(-(-jnp.max(kv_lens) // block_len), padded_pages // pages_per_block)

    qg = (q.astype(jnp.float32) * scale).reshape(num_tokens, num_kv_heads, group, head_dim)

    def visit_block(block, carry):
        running_max, denom, acc = carry
        block_pages = jax.lax.dynamic_slice_in_dim(tables, block * pages_per_block, pages_per_block, axis=1)
        k = pages.k[block_pages].reshape(num_tokens, block_len, num_kv_heads, head_dim).astype(jnp.float32)
        v = pages.v[block_pages].reshape(num_tokens, block_len, num_kv_heads, head_dim).astype(jnp.float32)
        kv_pos = block * block_len + jnp.arange(block_len)
        mask = (kv_pos[None, :] <= query_pos[:, None]) & (kv_pos[None, :] < kv_lens[:, None])
        if sliding_window is not None:
            mask &= kv_pos[None, :] > query_pos[:, None] - sliding_window
        scores = jnp.einsum("thgd,tkhd->thgk", qg, k)
        if soft_cap is not None:
            scores = soft_cap * jnp.tanh(scores / soft_cap)
        mask = mask[:, None, None, :]
        scores = jnp.where(mask, scores, MASK_VALUE)
        new_max = jnp.maximum(running_max, scores.max(axis=-1))
        probs = jnp.where(mask, jnp.exp(scores - new_max[..., None]), 0.0)
        correction = jnp.exp(running_max - new_max)
        denom = denom * correction + probs.sum(axis=-1)
        acc = acc * correction[..., None] + jnp.einsum("thgk,tkhd->thgd", probs, v)
        return new_max, denom, acc

    init = (
        jnp.full((num_tokens, num_kv_heads, group), MASK_VALUE, jnp.float32),
        jnp.zeros((num_tokens, num_kv_heads, group), jnp.float32),
        jnp.zeros((num_tokens, num_kv_heads, group, head_dim), jnp.float32),
    )
    _, denom, acc = jax.lax.fori_loop(0, num_blocks, visit_block, init)
    out = acc / jnp.where(denom > 0, denom, 1.0)[..., None]
    return out.reshape(num_tokens, num_heads, head_dim).astype(q.dtype)
