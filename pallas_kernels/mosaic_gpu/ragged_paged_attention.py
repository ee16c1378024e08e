"""Ragged paged attention for NVIDIA Hopper (sm90): a Pallas kernel lowered through Mosaic GPU.

Same contract as `pallas_kernels.gpu.ragged_paged_attention` (Triton) and the plain-JAX reference
`jserve.attention.paged_attention`: flat ragged query tokens q [T, heads, head_dim], K/V pages
[P, page_size, kv_heads, head_dim], context_lens [S], page_tables [S, max_pages], query_start_loc [S+1];
causal per sequence, GQA, optional sliding window and logit soft-cap; padding tokens come back as zeros.

How work maps onto the GPU
--------------------------
- A *row* is a run of consecutive query tokens of one sequence: one token for a decode, up to
  `block_q = tile_rows // group` tokens of a prefill chunk (group = query heads per KV head).
- A *tile* is one row for one KV head: its tokens x the KV head's `group` query heads, flattened to
  `tile_rows` (64 by default: one warpgroup's WGMMA M) rows of head_dim, token-major
  (tile row m = token m // group, query head m % group); rows past count x group are padding.
  XLA gathers the ragged queries into these dense tiles before the kernel and scatters the tiles'
  outputs back to [T, heads, head_dim] after it, so the kernel only moves whole, aligned tiles with TMA.
- One CUDA block (one warpgroup, 128 threads) attends one tile over one KV split: grid
  (rows, kv_heads, kv_splits). All `group` query heads share every K/V tile it fetches (GQA).
- K/V are walked `pages_per_block` pages at a time (a block of `pages_per_block * page_size` keys):
  each page of the block is a separate TMA copy, GMEM page `table[seq, i]` (one KV head's
  [page_size, head_dim] slab) into its rows of a 128-byte-swizzled SMEM buffer. Two buffers: block
  i + 1's pages are in flight while block i is multiplied.
- Scores are WGMMA (Q from SMEM, K^T from SMEM) into a float32 accumulator; scaling, soft-cap,
  causal / sliding-window masks and the online softmax (running max, denominator, rescaled output)
  are float32 in registers (WGMMA layout); P goes back to the input dtype, through SMEM, for the
  P @ V WGMMA.
- Decode rows are split-KV (flash-decoding): each of `kv_splits` programs writes a float32 partial
  with its log-sum-exp and XLA merges them, so few long sequences still fill the GPU's 132 SMs; a step
  with enough sequence slots to fill them runs one split (`split_rows.decode_splits`).
  Prefill rows walk their whole context in one program and write normalised outputs.
- Each program visits only the blocks between the sliding window's start for its first token and
  the causal end of its last token.

WGMMA takes 16-bit (or 8-bit) inputs: this kernel serves float16 and bfloat16 pages; float32 is
refused (Hopper's f32 WGMMA is TF32, which would not honour float32 accuracy). Shapes Mosaic GPU
cannot lower are refused up front: head_dim and K/V blocks (pages_per_block * page_size) must be
multiples of 64 (head_dim 64 and 128 fit the SMEM).

Status: tested in Pallas' GPU interpret mode against the reference, lowered for CUDA (sm90), and run
on an NVIDIA H200 against the reference (correct; slower there than the Triton kernel, which stays the GPU
default: docs/mosaic-gpu.md).
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import mosaic_gpu as plgpu

from pallas_kernels.split_rows import (
    DEFAULT_NUM_CORES,
    MASK_VALUE,
    decode_rows,
    decode_splits,
    default_pages_per_block,
    merge_splits,
    prefill_rows,
    sequence_spans,
    split_tables,
)

# Pallas' GPU interpreter runs this kernel on a CPU from jax 0.11 (0.10's cannot read the transposed K view).
INTERPRETABLE = hasattr(plgpu, "InterpretGPUParams")
WGMMA_M = 64  # one warpgroup's WGMMA tile height
SUPPORTED_DTYPES = (jnp.bfloat16, jnp.float16)


def supports(dtype, *, page_size: int, head_dim: int) -> bool:
    """Whether pages of this dtype and shape lower with the default K/V blocks (others are refused)."""
    return (
        jnp.dtype(dtype) in SUPPORTED_DTYPES
        and head_dim in (64, 128)
        and page_size % 8 == 0
        and default_pages_per_block(page_size) * page_size % 64 == 0
    )


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
    interpret=False,
    tile_rows: int = WGMMA_M,
    pages_per_block: int | None = None,
    kv_splits: int | None = None,
    num_cores: int = DEFAULT_NUM_CORES,
) -> jax.Array:
    """q [T, heads, head_dim] over pages [P, page_size, kv_heads, head_dim] -> [T, heads, head_dim].

    `interpret`: False compiles for the GPU; True (or an `InterpretGPUParams`) runs Pallas' GPU
    interpreter on the host. `tile_rows` (a multiple of 64) is the (token, query head) rows per tile;
    `pages_per_block` the pages per K/V block (default: 64 keys); `kv_splits` the splits of a
    decode's context (default: from the step's sequence slots and the GPU's `num_cores` SMs,
    `split_rows.decode_splits`).
    """
    num_tokens, num_heads, head_dim = q.shape
    page_size, num_kv_heads = k_pages.shape[1:3]
    group = num_heads // num_kv_heads
    if q.dtype not in SUPPORTED_DTYPES or k_pages.dtype != q.dtype or v_pages.dtype != q.dtype:
        raise NotImplementedError(
            f"Mosaic GPU attention takes float16/bfloat16 q and pages of the same dtype (WGMMA), got "
            f"q {q.dtype}, k {k_pages.dtype}, v {v_pages.dtype}"
        )
    if num_heads % num_kv_heads or tile_rows % WGMMA_M or group > tile_rows:
        raise ValueError(
            f"need heads % kv_heads == 0, tile_rows % 64 == 0 and group <= tile_rows: "
            f"{num_heads=} {num_kv_heads=} {tile_rows=}"
        )
    if pages_per_block is None:
        pages_per_block = default_pages_per_block(page_size)
    block_k = pages_per_block * page_size
    # What Mosaic GPU lowers (checked by lowering): WGMMA operands in 128-byte swizzled SMEM rows.
    if head_dim % 64 or block_k % 64 or page_size % 8:
        raise ValueError(
            f"need head_dim and pages_per_block * page_size multiples of 64, page_size of 8: "
            f"{head_dim=} {page_size=} {pages_per_block=}"
        )

    if kv_splits is None:
        kv_splits = decode_splits(page_tables.shape[0], num_kv_heads, num_cores)
    tables, kv_splits, blocks_per_split = split_tables(page_tables, pages_per_block, kv_splits)
    starts, q_lens, first_pos = sequence_spans(context_lens, query_start_loc)
    attend = functools.partial(
        _attend_rows,
        q,
        k_pages,
        v_pages,
        tables,
        group=group,
        tile_rows=tile_rows,
        scale=scale,
        sliding_window=sliding_window,
        soft_cap=soft_cap,
        pages_per_block=pages_per_block,
        interpret=interpret,
    )

    out = jnp.zeros_like(q)
    if num_tokens > 1:  # a one-token step holds no prefill chunk
        block_q = tile_rows // group
        rows = prefill_rows(starts, q_lens, first_pos, num_tokens, block_q)
        # One program walks a prefill row's whole context: [R, kv_heads, 1, tile_rows, D].
        tiles, _ = attend(rows, kv_splits=1, blocks_per_split=kv_splits * blocks_per_split, out_dtype=q.dtype)
        out = _scatter_tiles(out, tiles[:, :, 0], rows, group)

    rows = decode_rows(starts, q_lens, first_pos)
    partials, lse = attend(rows, kv_splits=kv_splits, blocks_per_split=blocks_per_split, out_dtype=jnp.float32)
    merged = merge_splits(partials, lse, axis=2).astype(q.dtype)  # [S, kv_heads, tile_rows, D]
    return _scatter_tiles(out, merged, rows, group)


def _tile_index(rows: jax.Array, group: int, tile_rows: int, num_kv_heads: int):
    """Token [R, 1, M] and query head [1, KVH, M] of each tile row, and whether it is real [R, 1, M]."""
    m = jnp.arange(tile_rows)
    tokens = rows[:, 0, None] + m // group
    valid = m < rows[:, 1, None] * group
    heads = jnp.arange(num_kv_heads)[:, None] * group + m % group
    return tokens[:, None], heads[None], valid[:, None]


def _gather_tiles(q: jax.Array, rows: jax.Array, group: int, tile_rows: int) -> jax.Array:
    """Query tiles [R, kv_heads, tile_rows, D] of the rows; padding rows are zeros."""
    num_tokens, num_heads, _ = q.shape
    tokens, heads, valid = _tile_index(rows, group, tile_rows, num_heads // group)
    tiles = q[jnp.where(valid, tokens, 0), heads]
    return jnp.where(valid[..., None], tiles, 0).astype(q.dtype)


def _scatter_tiles(out: jax.Array, tiles: jax.Array, rows: jax.Array, group: int) -> jax.Array:
    """Write tiles [R, kv_heads, tile_rows, D] into out [T, heads, D] at their rows' real tokens."""
    num_tokens, num_heads, _ = out.shape
    tokens, heads, valid = _tile_index(rows, group, tiles.shape[2], num_heads // group)
    tokens = jnp.where(valid, tokens, num_tokens)  # out of range -> dropped
    tokens, heads = jnp.broadcast_arrays(tokens, heads)
    return out.at[tokens, heads].set(tiles.astype(out.dtype), mode="drop")


def _attend_rows(
    q,
    k_pages,
    v_pages,
    tables,
    rows,
    *,
    kv_splits,
    blocks_per_split,
    out_dtype,
    group,
    tile_rows,
    interpret,
    **kernel_kw,
):
    """Run the kernel over rows x kv heads x splits: (outputs [R, KVH, splits, M, D], lse [R, KVH, splits, M])."""
    num_kv_heads, head_dim = k_pages.shape[2], k_pages.shape[3]
    num_rows = rows.shape[0]
    q_tiles = _gather_tiles(q, rows, group, tile_rows)
    out_types = (
        jax.ShapeDtypeStruct((num_rows, num_kv_heads, kv_splits, tile_rows, head_dim), out_dtype),
        jax.ShapeDtypeStruct((num_rows, num_kv_heads, kv_splits, tile_rows), jnp.float32),
    )
    block_k = kernel_kw["pages_per_block"] * k_pages.shape[1]
    transforms = _smem_transforms(head_dim, q.dtype)
    scratch = (
        plgpu.SMEM((tile_rows, head_dim), q.dtype, transforms=transforms),  # the query tile
        plgpu.SMEM((2, block_k, head_dim), q.dtype, transforms=transforms),  # K blocks, double-buffered
        plgpu.SMEM((2, block_k, head_dim), q.dtype, transforms=transforms),  # V blocks
        plgpu.SMEM((tile_rows, block_k), q.dtype, transforms=_smem_transforms(block_k, q.dtype)),  # P
        plgpu.SMEM((tile_rows, head_dim), out_dtype),  # the output tile on its way out
        plgpu.SMEM((tile_rows,), jnp.float32),  # its log-sum-exps
        plgpu.Barrier(num_arrivals=1, num_barriers=1),  # the query tile has landed
        plgpu.Barrier(num_arrivals=kernel_kw["pages_per_block"], num_barriers=2),  # a K block has landed
        plgpu.Barrier(num_arrivals=kernel_kw["pages_per_block"], num_barriers=2),  # a V block has landed
    )
    if interpret is True:
        if not INTERPRETABLE:
            raise NotImplementedError(f"Pallas' GPU interpreter runs this kernel from jax 0.11, not {jax.__version__}")
        interpret = plgpu.InterpretGPUParams()
    kernel = functools.partial(_tile_kernel, group=group, blocks_per_split=blocks_per_split, **kernel_kw)
    return plgpu.kernel(
        kernel,
        out_type=out_types,
        scratch_types=scratch,
        grid=(num_rows, num_kv_heads, kv_splits),
        grid_names=("row", "kv_head", "split"),
        interpret=interpret or None,
    )(rows, tables, q_tiles, k_pages, v_pages)


def _smem_transforms(minor_dim: int, dtype) -> tuple:
    """Swizzled SMEM tiles (8 rows x up to 128 bytes), the layout WGMMA reads its operands in."""
    itemsize = jnp.dtype(dtype).itemsize
    swizzle = plgpu.find_swizzle(minor_dim * itemsize * 8)
    return plgpu.TilingTransform((8, swizzle // itemsize)), plgpu.SwizzleTransform(swizzle)


def _tile_kernel(
    rows_ref,  # [R, ROW_FIELDS] int32 (GMEM)
    tables_ref,  # [S, padded_pages] int32 (GMEM)
    q_ref,  # [R, KVH, M, D] query tiles (GMEM)
    k_ref,  # [P, page_size, KVH, D] (GMEM)
    v_ref,
    out_ref,  # [R, KVH, splits, M, D] (GMEM)
    lse_ref,  # [R, KVH, splits, M] float32 (GMEM)
    q_smem,
    k_smem,
    v_smem,
    p_smem,
    o_smem,
    lse_smem,
    q_barrier,
    k_barriers,
    v_barriers,
    *,
    scale: float,
    sliding_window: int | None,
    soft_cap: float | None,
    pages_per_block: int,
    blocks_per_split: int,
    group: int,
):
    row, kv_head, split = lax.axis_index("row"), lax.axis_index("kv_head"), lax.axis_index("split")
    count, first_pos, seq = rows_ref[row, 1], rows_ref[row, 2], rows_ref[row, 3]
    tile_rows, head_dim = q_smem.shape
    page_size = k_ref.shape[1]
    block_k = pages_per_block * page_size

    # The K/V blocks this program visits: its split, cut to [window start of the first token, causal end].
    kv_end = jnp.where(count > 0, first_pos + count, 0)
    kv_start = 0 if sliding_window is None else jnp.maximum(first_pos - sliding_window + 1, 0)
    lo = jnp.maximum(split * blocks_per_split, lax.div(kv_start, block_k))
    hi = jnp.minimum((split + 1) * blocks_per_split, lax.div(kv_end + block_k - 1, block_k))

    def fetch(block, slot):
        """Start the TMA copies of block's pages (this KV head's slab of each) into buffer slot."""
        for j in range(pages_per_block):
            page = tables_ref[seq, block * pages_per_block + j]
            keys = pl.ds(j * page_size, page_size)
            plgpu.copy_gmem_to_smem(k_ref.at[page, :, kv_head, :], k_smem.at[slot, keys], k_barriers.at[slot])
            plgpu.copy_gmem_to_smem(v_ref.at[page, :, kv_head, :], v_smem.at[slot, keys], v_barriers.at[slot])

    plgpu.copy_gmem_to_smem(q_ref.at[row, kv_head], q_smem, q_barrier.at[0])

    @pl.when(lo < hi)
    def _():
        fetch(lo, 0)

    plgpu.barrier_wait(q_barrier.at[0])

    # Register arrays live in WGMMA's accumulator layout (row statistics: its row-reduced form).
    layout = plgpu.Layout.WGMMA

    def iota(dimension):
        return plgpu.broadcasted_iota(jnp.int32, (tile_rows, block_k), dimension, layout=layout)

    def full(shape, value, layout):
        return plgpu.layout_cast(jnp.full(shape, value, jnp.float32), layout)

    # Tile row m is query token m // group of the row: its position, or -1 (attends to nothing) for padding.
    m = iota(0)
    q_pos = jnp.where(m < count * group, first_pos + lax.div(m, group), -1)
    key_in_block = iota(1)

    def visit(block, carry):
        running_max, denom, acc = carry
        slot = lax.rem(block - lo, 2)

        @pl.when(block + 1 < hi)  # the other buffer was last read by the previous block's (finished) WGMMAs
        def _():
            fetch(block + 1, 1 - slot)

        plgpu.barrier_wait(k_barriers.at[slot])

        def qk(acc_ref):
            plgpu.wgmma(acc_ref, q_smem, k_smem.at[slot].T)  # K^T: a transposed SMEM view
            return acc_ref[...]

        scores = pl.run_scoped(qk, plgpu.ACC((tile_rows, block_k), jnp.float32)) * scale
        if soft_cap is not None:
            scores = soft_cap * jnp.tanh(scores * (1.0 / soft_cap))
        kv_pos = block * block_k + key_in_block
        mask = kv_pos <= q_pos
        if sliding_window is not None:
            mask = mask & (kv_pos > q_pos - sliding_window)
        scores = jnp.where(mask, scores, MASK_VALUE)
        new_max = jnp.maximum(running_max, scores.max(axis=1))
        probs = jnp.where(mask, jnp.exp(scores - lax.broadcast_in_dim(new_max, scores.shape, [0])), 0.0)
        correction = jnp.exp(running_max - new_max)
        denom = denom * correction + probs.sum(axis=1)

        # P goes through SMEM: WGMMA reads it from there (Pallas' GPU interpreter has no register operand).
        p_smem[...] = probs.astype(p_smem.dtype)
        plgpu.commit_smem()
        plgpu.barrier_wait(v_barriers.at[slot])

        def pv(acc_ref):
            plgpu.wgmma(acc_ref, p_smem, v_smem.at[slot])
            return acc_ref[...]

        acc = acc * lax.broadcast_in_dim(correction, acc.shape, [0])
        acc = acc + pl.run_scoped(pv, plgpu.ACC((tile_rows, head_dim), jnp.float32))
        return new_max, denom, acc

    init = (
        full((tile_rows,), MASK_VALUE, layout.reduce(1)),
        full((tile_rows,), 0.0, layout.reduce(1)),
        full((tile_rows, head_dim), 0.0, layout),
    )
    running_max, denom, acc = lax.fori_loop(lo, hi, visit, init)

    seen = denom > 0
    safe_denom = jnp.where(seen, denom, 1.0)
    o_smem[...] = (acc / lax.broadcast_in_dim(safe_denom, acc.shape, [0])).astype(o_smem.dtype)
    lse_smem[...] = jnp.where(seen, running_max + jnp.log(safe_denom), MASK_VALUE)
    plgpu.commit_smem()
    plgpu.copy_smem_to_gmem(o_smem, out_ref.at[row, kv_head, split])
    plgpu.copy_smem_to_gmem(lse_smem, lse_ref.at[row, kv_head, split])
    plgpu.wait_smem_to_gmem(0)
