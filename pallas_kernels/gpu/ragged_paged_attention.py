"""Ragged paged attention for NVIDIA GPUs: Pallas kernels lowered through Triton.

The flat query tokens of a mixed batch are cut into *rows*: runs of consecutive query tokens of one
sequence. One program attends one row for one KV head, so all of the head's query heads (GQA) share
each K/V tile: the query tile is [row tokens x query heads, head_dim].

- Decode rows (sequences with one new token) are split-KV (flash-decoding): the context is divided
  among `kv_splits` programs, which write partial outputs with their log-sum-exp; a small kernel merges
  them into the output, in place. Few long sequences still fill the GPU this way; a step with enough
  sequence slots to fill it runs one split (`split_rows.decode_splits`), whose programs write their outputs
  in place as prefill rows do (no partials, no merge).
- Prefill rows hold up to `block_q` tokens and walk their context in one program, skipping K/V blocks
  past the causal limit of their last token or before the sliding window of their first.

Both walk the context `pages_per_block` pages at a time with an online softmax in float32. How each is
launched (block sizes, warps, pipelining stages, splits per SM) comes from `launch.py`: measured per GPU where
a measurement exists.

Why Triton: it is the one Pallas GPU backend that covers every NVIDIA generation users serve on
(T4 sm75, A100 sm80, L4 sm89, H100/H200 sm90); Mosaic GPU targets sm90+ only (`pallas_kernels.mosaic_gpu`,
behind the same contract). JAX deprecates Triton lowering from 0.11 on; it still lowers and runs there (an
H200 ran this kernel under jax 0.11.2).
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plt

from pallas_kernels.gpu.launch import AttentionShape, DecodeLaunch, PrefillLaunch, tuned_launches
from pallas_kernels.split_rows import (
    DEFAULT_NUM_CORES,
    MASK_VALUE,
    ROW_FIELDS,
    decode_rows,
    decode_splits,
    default_pages_per_block,
    prefill_rows,
    sequence_spans,
    split_tables,
)

MIN_DOT = 16  # Triton's dot wants every dimension >= 16
# Triton's blocks are powers of two: the K/V pages a block loads, [pages_per_block, page_size, head_dim], and
# the query tile's head_dim. The key blocks reach MIN_DOT whatever the page size.
SHAPE_REQUIREMENT = f"page_size a power of two and head_dim a power of two >= {MIN_DOT}"


def supports(*, page_size: int, head_dim: int) -> bool:
    """Whether Triton lowers this kernel for pages [P, page_size, kv_heads, head_dim] (SHAPE_REQUIREMENT)."""
    return _is_power_of_two(page_size) and _is_power_of_two(head_dim) and head_dim >= MIN_DOT


def _is_power_of_two(n: int) -> bool:
    return n > 0 and n & (n - 1) == 0


def ragged_paged_attention(
    q: jax.Array,
    k_pages: jax.Array,
    v_pages: jax.Array,
    context_lens: jax.Array,
    page_tables: jax.Array,
    query_start_loc: jax.Array,
    *,
    scale: float,
    sliding_window: int | None = None,
    soft_cap: float | None = None,
    interpret: bool = False,
    decode: DecodeLaunch | None = None,
    prefill: PrefillLaunch | None = None,
    kv_splits: int | None = None,
    num_cores: int = DEFAULT_NUM_CORES,
    device_kind: str | None = None,
    page_offset: jax.Array | int | None = None,
) -> jax.Array:
    """q [T, heads, head_dim] over pages [P, page_size, kv_heads, head_dim] -> [T, heads, head_dim].

    page_offset: added to every page id read from page_tables (a layer's first page in a cache of every
    layer's pages), inside the kernel: added to the tables, it would be a kernel launch of its own.

    decode, prefill: how each program is launched (default: what launch.py holds measured for `device_kind`
    and this shape, else its defaults). kv_splits: the splits of a decode's context (default: from the step's
    sequence slots and the GPU's `num_cores` SMs, `split_rows.decode_splits`).
    """
    num_tokens, num_heads, head_dim = q.shape
    page_size, num_kv_heads = k_pages.shape[1:3]
    if not supports(page_size=page_size, head_dim=head_dim):
        raise ValueError(f"the Triton attention kernel needs {SHAPE_REQUIREMENT}, got {page_size=}, {head_dim=}")
    if decode is None or prefill is None:
        shape = AttentionShape(device_kind or "", jnp.dtype(k_pages.dtype).name, head_dim, num_heads // num_kv_heads,
                               page_size)  # fmt: skip
        tuned_decode, tuned_prefill = tuned_launches(shape)
        decode, prefill = decode or tuned_decode, prefill or tuned_prefill
    starts, q_lens, first_pos = sequence_spans(context_lens, query_start_loc)
    offset = jnp.asarray(0 if page_offset is None else page_offset, jnp.int32).reshape(1)
    kernel_args = dict(scale=scale, sliding_window=sliding_window, soft_cap=soft_cap, page_size=page_size,
                       interpret=interpret)  # fmt: skip

    # Prefill rows write straight into the (zeroed) output; decode rows come back per split.
    out = jnp.zeros_like(q)
    if num_tokens > 1:  # a one-token step holds no prefill chunk
        pages_per_block = _pages_per_block(prefill.pages_per_block, page_size, page_tables)
        tables, _, _ = split_tables(page_tables, pages_per_block, 1)
        rows = prefill_rows(starts, q_lens, first_pos, num_tokens, prefill.block_q)
        out = _attend_rows(q, k_pages, v_pages, tables, offset, rows, out, prefill.block_q, 1,
                           pages_per_block=pages_per_block, num_warps=prefill.num_warps, num_stages=prefill.num_stages,
                           **kernel_args)  # fmt: skip

    if kv_splits is None:
        kv_splits = decode_splits(page_tables.shape[0], num_kv_heads, num_cores, decode.programs_per_core)
    pages_per_block = _pages_per_block(decode.pages_per_block, page_size, page_tables)
    tables, kv_splits, _ = split_tables(page_tables, pages_per_block, kv_splits)
    rows = decode_rows(starts, q_lens, first_pos)
    kernel_args.update(pages_per_block=pages_per_block, num_warps=decode.num_warps, num_stages=decode.num_stages)
    if kv_splits == 1:  # whole contexts: written in place as prefill rows are, no partials to merge
        return _attend_rows(q, k_pages, v_pages, tables, offset, rows, out, 1, 1, **kernel_args)
    partial_out, lse = _attend_rows(q, k_pages, v_pages, tables, offset, rows, None, 1, kv_splits, **kernel_args)
    return _merge_splits(rows, partial_out, lse, out, kv_splits, interpret=interpret)


def _pages_per_block(pages_per_block: int | None, page_size: int, page_tables) -> int:
    """The pages a K/V block loads: as asked (default 64 keys), no more than the page tables hold, but at
    least MIN_DOT keys (a power of two: page_size is one)."""
    if pages_per_block is None:
        pages_per_block = default_pages_per_block(page_size)
    return max(min(pages_per_block, pl.next_power_of_2(page_tables.shape[1])), pl.cdiv(MIN_DOT, page_size))


def _attend_rows(
    q,
    k_pages,
    v_pages,
    tables,
    offset,
    rows,
    out,
    block_q: int,
    kv_splits: int,
    *,
    interpret,
    num_warps,
    num_stages,
    **kw,
):
    """Run the kernel over rows x kv heads x splits.

    Given `out` (prefill rows, one split), it writes normalised outputs into it (aliased, in place) at the
    rows' tokens; otherwise (decode rows, one token each) it returns (partials [R, splits, heads, D],
    their log-sum-exps [R, splits, heads]) of kv_splits splits, padded to a power of two (the rest unwritten).
    """
    num_tokens, num_heads, head_dim = q.shape
    num_kv_heads = k_pages.shape[2]
    group = num_heads // num_kv_heads
    # Query heads per KV head, padded to a power of two (and so the tile has >= MIN_DOT rows).
    heads_tile = max(pl.next_power_of_2(group), pl.cdiv(MIN_DOT, block_q))
    num_rows = rows.shape[0]
    blocks_per_split = tables.shape[1] // kw["pages_per_block"] // kv_splits
    kernel = functools.partial(
        _row_kernel,
        block_q=block_q,
        group=group,
        heads_tile=heads_tile,
        blocks_per_split=blocks_per_split,
        split_kv=out is None,
        **kw,
    )
    if out is not None:
        out_shape = jax.ShapeDtypeStruct(q.shape, q.dtype)
        aliases = {6: 0}
        operands = (rows, tables, offset, q, k_pages, v_pages, out)
    else:
        splits = pl.next_power_of_2(kv_splits)  # (the merge loads the split axis whole: Triton's blocks are)
        out_shape = (
            jax.ShapeDtypeStruct((num_rows, splits, num_heads, head_dim), jnp.float32),
            jax.ShapeDtypeStruct((num_rows, splits, num_heads), jnp.float32),
        )
        aliases = {}
        operands = (rows, tables, offset, q, k_pages, v_pages)
    return pl.pallas_call(
        kernel,
        out_shape=out_shape,
        grid=(num_rows, num_kv_heads, kv_splits),
        input_output_aliases=aliases,
        interpret=interpret,
        compiler_params=plt.CompilerParams(num_warps=num_warps, num_stages=num_stages),
        name=f"ragged_paged_attention_{'prefill' if out is not None else 'decode'}",
    )(*operands)


def _row_kernel(
    rows_ref,  # [R, ROW_FIELDS] int32
    tables_ref,  # [S, padded_pages] int32
    offset_ref,  # [1] int32: added to the tables' page ids
    q_ref,  # [T, heads, D]
    k_ref,  # [P, page_size, kv_heads, D]
    v_ref,
    *out_refs,  # prefill: (aliased input, out [T, heads, D]); decode: (partials, lse)
    scale: float,
    sliding_window: int | None,
    soft_cap: float | None,
    page_size: int,
    pages_per_block: int,
    blocks_per_split: int,
    block_q: int,
    group: int,
    heads_tile: int,
    split_kv: bool,
):
    row, kv_head, split = pl.program_id(0), pl.program_id(1), pl.program_id(2)
    first_token, count, first_pos, seq = (rows_ref[row, i] for i in range(ROW_FIELDS))
    head_dim = q_ref.shape[-1]
    block_k = pages_per_block * page_size
    tile = block_q * heads_tile

    # The query tile: block_q tokens x heads_tile heads, row-major, flattened to [tile, D].
    token_in_row = jnp.arange(tile) // heads_tile
    head_in_group = jnp.arange(tile) % heads_tile
    valid = (token_in_row < count) & (head_in_group < group)
    q_pos = jnp.where(valid, first_pos + token_in_row, -1)  # -1 attends to nothing
    tokens, heads = pl.ds(first_token, block_q), pl.ds(kv_head * group, heads_tile)
    q_mask = valid.reshape(block_q, heads_tile, 1)
    q = plt.load(q_ref.at[tokens, heads, :], mask=q_mask, other=0).reshape(tile, head_dim)

    # K/V blocks this program visits: its split, cut to [window start, causal end) of the row.
    kv_end = jnp.where(count > 0, first_pos + count, 0)
    kv_start = 0 if sliding_window is None else jnp.maximum(first_pos - sliding_window + 1, 0)
    lo = jnp.maximum(split * blocks_per_split, kv_start // block_k)
    hi = jnp.minimum((split + 1) * blocks_per_split, pl.cdiv(kv_end, block_k))

    def visit(block, carry):
        running_max, denom, acc = carry
        pages = tables_ref[seq, pl.ds(block * pages_per_block, pages_per_block)] + offset_ref[0]
        k = k_ref[pages, :, kv_head, :].reshape(block_k, head_dim)
        v = v_ref[pages, :, kv_head, :].reshape(block_k, head_dim)
        scores = _dot(q, k.T) * scale
        if soft_cap is not None:
            scores = soft_cap * jnp.tanh(scores / soft_cap)
        kv_pos = block * block_k + jnp.arange(block_k)
        mask = kv_pos[None, :] <= q_pos[:, None]
        if sliding_window is not None:
            mask &= kv_pos[None, :] > q_pos[:, None] - sliding_window
        scores = jnp.where(mask, scores, MASK_VALUE)
        new_max = jnp.maximum(running_max, scores.max(axis=1))
        probs = jnp.where(mask, jnp.exp(scores - new_max[:, None]), 0.0)
        correction = jnp.exp(running_max - new_max)
        denom = denom * correction + probs.sum(axis=1)
        acc = acc * correction[:, None] + _dot(probs.astype(v.dtype), v)
        return new_max, denom, acc

    init = (
        jnp.full((tile,), MASK_VALUE, jnp.float32),
        jnp.zeros((tile,), jnp.float32),
        jnp.zeros((tile, head_dim), jnp.float32),
    )
    running_max, denom, acc = jax.lax.fori_loop(lo, hi, visit, init)
    out = acc / jnp.where(denom > 0, denom, 1.0)[:, None]

    if split_kv:  # one token per row: store the partial and its log-sum-exp per query head
        partial_ref, lse_ref = out_refs
        head_mask = valid[:heads_tile]
        lse = jnp.where(denom > 0, running_max + jnp.log(jnp.where(denom > 0, denom, 1.0)), MASK_VALUE)
        plt.store(partial_ref.at[row, split, heads, :], out[:heads_tile], mask=head_mask[:, None])
        plt.store(lse_ref.at[row, split, heads], lse[:heads_tile], mask=head_mask)
    else:
        out_ref = out_refs[1]
        out = out.reshape(block_q, heads_tile, head_dim).astype(out_ref.dtype)
        plt.store(out_ref.at[tokens, heads, :], out, mask=q_mask)


def _merge_splits(rows, partials, lse, out, kv_splits: int, *, interpret: bool) -> jax.Array:
    """Each decode row's split partials [R, splits, heads, D] weighted by their log-sum-exps [R, splits, heads],
    written into `out` [T, heads, D] (aliased, in place) at the row's token: one kernel a step. (XLA's merge
    gave the weights a kernel of their own from 8 splits on, and a lone decode has up to MAX_KV_SPLITS.)"""
    num_rows, _, num_heads, _ = partials.shape
    return pl.pallas_call(
        functools.partial(_merge_kernel, kv_splits=kv_splits),
        out_shape=jax.ShapeDtypeStruct(out.shape, out.dtype),
        grid=(num_rows, num_heads),
        input_output_aliases={3: 0},
        interpret=interpret,
        compiler_params=plt.CompilerParams(num_warps=1),
        name="ragged_paged_attention_merge",
    )(rows, partials, lse, out)


def _merge_kernel(rows_ref, partial_ref, lse_ref, _, out_ref, *, kv_splits: int):
    """One query head of one decode row: its splits' partials [splits, D] merged (a softmax over their
    log-sum-exps; a split that saw nothing has MASK_VALUE and weighs 0)."""
    row, head = pl.program_id(0), pl.program_id(1)
    token, count = rows_ref[row, 0], rows_ref[row, 1]
    splits = partial_ref.shape[1]  # kv_splits padded to a power of two: the rest is unwritten, masked here
    present = jnp.arange(splits) < kv_splits
    lse = plt.load(lse_ref.at[row, pl.ds(0, splits), head], mask=present, other=MASK_VALUE)
    weights = jnp.where(lse > MASK_VALUE / 2, jnp.exp(lse - lse.max()), 0.0)
    partials = plt.load(partial_ref.at[row, pl.ds(0, splits), head, :], mask=present[:, None], other=0.0)
    total = weights.sum()
    merged = (partials * weights[:, None]).sum(axis=0) / jnp.where(total > 0, total, 1.0)
    written = jnp.full(merged.shape, count > 0)  # (rows past the step's decodes have no token here)
    plt.store(out_ref.at[token, head, :], merged.astype(out_ref.dtype), mask=written)


def _dot(a: jax.Array, b: jax.Array) -> jax.Array:
    """float32-accumulated matmul; float32 inputs keep full precision (no TF32)."""
    precision = jax.lax.Precision.HIGHEST if a.dtype == jnp.float32 else None
    return jnp.dot(a, b, preferred_element_type=jnp.float32, precision=precision)
