"""Ragged paged attention for TPUs: a Pallas Mosaic kernel over a mixed batch of prefill chunks and decodes.

It implements the contract of `jserve.attention.paged_attention` (the plain-JAX reference).

Layout, and why:
- Work is cut into rows as in the reference: each sequence with one new token (a decode) is a row of one
  query; longer chunks (prefills) are cut into rows of `block_q` consecutive queries of one sequence. The
  row metadata is computed in plain JAX and scalar-prefetched into SMEM; the grid walks the rows, so every
  grid step attends to one sequence's pages.
- The page tables stay in HBM: each row DMAs its sequence's table into one of two SMEM slots, the next
  row's while this one computes. Prefetching every table would need max_num_seqs x max_pages words of SMEM
  (8 MiB for 256 sequences of 128k tokens in pages of 16, against 1 MiB of SMEM); two slots need
  2 x max_pages (`smem_bytes` counts what a step needs).
- q is gathered into [rows, kv_heads, queries * group, head_dim]: all query heads of a kv head, for all
  queries of the row, form one [M, head_dim] matrix, so GQA costs one MXU matmul per kv head and KV block
  and needs no in-kernel reshape. Outputs are scattered back to the flat token order.
- K/V pages stay in HBM and are DMA'd a page at a time into a two-slot VMEM buffer, one KV block
  (`pages_per_block` pages) per slot. The next block's copies (at a row's last block: the next row's first
  block) start before the current block is computed, so DMA hides behind compute across rows too; that
  makes the grid sequential ("arbitrary").
- Only pages a row can see are fetched: KV blocks past the causal limit of its last query, or before the
  sliding-window start of its first query, are never visited, and such pages inside the boundary blocks
  are not copied.
- Online softmax in float32, with running max, denominator and accumulator in VMEM scratch.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import tpu as pltpu

# Finite, so fully masked query slots give zeros rather than NaNs.
MASK_VALUE = -1e30
# The running max and denominator are kept replicated across a vreg's 128 lanes: whole-vreg stores.
_LANES = 128
BLOCK_Q = 32  # queries per prefill row
# SMEM per TensorCore of TPU v4, v5e, v5p, v6e and 7x: 1 MiB (v2 and v3: 16 KiB), as jax lists them in
# jax/_src/pallas/mosaic/tpu_info.py. A kernel's SMEM operands and scratch must fit in it beside Mosaic's own.
SMEM_BYTES = 1 << 20
# Mosaic lays 1-D SMEM arrays out in tiles of 128 32-bit words (as its own SMEM operands): sizes are
# counted in whole tiles, and each page-table slot starts on one.
_SMEM_TILE = 128
_ROW_FIELDS = 4  # scalar-prefetched int32s per row: _Rows' fields besides first_token


@dataclass(frozen=True)
class _Config:
    """Static shapes and options of one kernel launch."""

    queries_per_row: int
    group: int  # query heads per kv head
    page_size: int
    pages_per_block: int
    max_pages: int  # page-table columns
    scale: float
    sliding_window: int | None
    soft_cap: float | None

    @property
    def block_kv(self) -> int:
        return self.pages_per_block * self.page_size

    @property
    def table_stride(self) -> int:
        """Words from one SMEM page-table slot to the next."""
        return _smem_words(self.max_pages)


@jax.tree_util.register_dataclass
@dataclass(frozen=True)
class _Rows:
    """Rows of up to `queries_per_row` consecutive query tokens of one sequence; rows with work come first."""

    first_token: jax.Array  # [R] the row's first query in the flat batch
    seq: jax.Array  # [R] its sequence
    first_pos: jax.Array  # [R] the position of its first query in the sequence
    num_queries: jax.Array  # [R] 0 for rows without work
    first_slot: jax.Array  # [R] the buffer slot of its first KV block (slots alternate block by block)


@dataclass(frozen=True)
class _Refs:
    """The kernel's operands."""

    seq: Any  # SMEM [R]
    first_pos: Any  # SMEM [R]
    num_queries: Any  # SMEM [R]
    first_slot: Any  # SMEM [R]
    tables_hbm: Any  # HBM [S * table_stride]: the page tables, each padded to whole SMEM tiles
    q: Any  # VMEM [kv_heads, M, head_dim]: this row's queries, M = queries_per_row * group
    k_hbm: Any  # HBM [num_pages, page_size, kv_heads, head_dim]
    v_hbm: Any
    out: Any  # VMEM [kv_heads, M, head_dim]
    tables: Any  # SMEM [2 * table_stride]: the page tables of this row (slot row % 2) and the next
    table_sem: Any  # DMA semaphore of the page-table copies (at most one in flight)
    k_buf: Any  # VMEM [2, block_kv, kv_heads, head_dim]: per slot, a KV block's pages back to back
    v_buf: Any
    sems: Any  # DMA semaphores [2], one per slot
    running_max: Any  # VMEM f32 [kv_heads, M, _LANES]
    denom: Any  # VMEM f32 [kv_heads, M, _LANES]: running softmax denominator
    acc: Any  # VMEM f32 [kv_heads, M, head_dim]: unnormalised output


def _smem_words(n: int) -> int:
    """Words of SMEM an int32 array of n elements takes."""
    return pl.cdiv(n, _SMEM_TILE) * _SMEM_TILE


def _row_groups(num_tokens: int, num_seqs: int, block_q: int) -> tuple[tuple[int, int], tuple[int, int]]:
    """(queries per row, most rows) of the decode launch and of the prefill launch. n queries take
    ceil(n / per_row) rows, so prefills (chunks of two or more) take at most
    (T - max_prefills) // block_q + max_prefills."""
    max_prefills = min(num_seqs, num_tokens // 2)
    return (1, min(num_seqs, num_tokens)), (block_q, (num_tokens - max_prefills) // block_q + max_prefills)


def smem_capacity() -> int:
    """SMEM per core of the TPU in context (this host's, or an abstract mesh's); SMEM_BYTES for a chip this
    jax does not know."""
    try:
        return pltpu.get_tpu_info().smem_capacity_bytes
    except ValueError:
        return SMEM_BYTES


def smem_bytes(num_tokens: int, num_seqs: int, max_pages: int, block_q: int = BLOCK_Q) -> int:
    """SMEM a step of num_tokens queries in num_seqs sequence slots with page tables of max_pages columns
    needs: per launch, its rows' scalar-prefetched metadata and two page-table slots."""
    most_rows = max(num_rows for _, num_rows in _row_groups(num_tokens, num_seqs, block_q))
    return 4 * (_ROW_FIELDS * _smem_words(most_rows) + 2 * _smem_words(max_pages))


def _kv_span(
    first_pos: jax.Array, num_queries: jax.Array, sliding_window: int | None
) -> tuple[jax.Array | int, jax.Array]:
    """[lo, hi): the kv positions that some query of a row may attend to."""
    hi = first_pos + num_queries  # the last query sees itself and everything before it
    lo = 0 if sliding_window is None else jnp.maximum(first_pos - sliding_window + 1, 0)
    return lo, hi


def _block_span(first_pos: jax.Array, num_queries: jax.Array, cfg: _Config) -> tuple[jax.Array, jax.Array]:
    """[first, end): the KV blocks a row visits; empty for a row without work."""
    lo, hi = _kv_span(first_pos, num_queries, cfg.sliding_window)
    first = lo // cfg.block_kv
    return first, jnp.where(num_queries > 0, pl.cdiv(hi, cfg.block_kv), first)


def _query_rows(
    query_start_loc: jax.Array, context_lens: jax.Array, selected: jax.Array, num_rows: int, cfg: _Config
) -> _Rows:
    """Cut the queries of the selected sequences into rows, `num_rows` of them (a static upper bound)."""
    num_seqs = context_lens.shape[0]
    starts = query_start_loc[:-1]
    q_lens = query_start_loc[1:] - starts
    rows_per_seq = jnp.where(selected, pl.cdiv(q_lens, cfg.queries_per_row), 0)
    row_ends = jnp.cumsum(rows_per_seq)
    row = jnp.arange(num_rows)
    seq = jnp.minimum(jnp.searchsorted(row_ends, row, side="right"), num_seqs - 1)
    offset = (row - (row_ends[seq] - rows_per_seq[seq])) * cfg.queries_per_row  # within the chunk
    num_queries = jnp.where(row < row_ends[-1], jnp.clip(q_lens[seq] - offset, 0, cfg.queries_per_row), 0)
    first_pos = context_lens[seq] - q_lens[seq] + offset
    first_block, end_block = _block_span(first_pos, num_queries, cfg)
    blocks = end_block - first_block
    return _Rows(starts[seq] + offset, seq, first_pos, num_queries, (jnp.cumsum(blocks) - blocks) % 2)


@dataclass(frozen=True)
class _BlockCopy:
    """The DMAs bringing one KV block of a row's sequence into a buffer slot: only the pages the row sees."""

    refs: _Refs
    cfg: _Config
    row: jax.Array
    block: jax.Array
    slot: jax.Array

    def start(self) -> None:
        self._each_page(lambda copy: copy.start())

    def wait(self) -> None:
        self._each_page(lambda copy: copy.wait())

    def _each_page(self, action: Callable[[Any], None]) -> None:
        refs, cfg = self.refs, self.cfg
        lo, hi = _kv_span(refs.first_pos[self.row], refs.num_queries[self.row], cfg.sliding_window)
        first_page, end_page = lo // cfg.page_size, pl.cdiv(hi, cfg.page_size)
        for i in range(cfg.pages_per_block):
            page = self.block * cfg.pages_per_block + i
            # start() and wait() take the same branches, so every started copy is waited for.
            pl.when((page >= first_page) & (page < end_page))(functools.partial(self._copy_page, action, i, page))

    def _copy_page(self, action: Callable[[Any], None], i: int, page: jax.Array) -> None:
        """Page `page` of the sequence -> the i-th page of the slot, for K and V."""
        refs, page_size = self.refs, self.cfg.page_size
        physical = refs.tables[(self.row % 2) * self.cfg.table_stride + page]
        dst = pl.ds(i * page_size, page_size)
        for pages, buf in ((refs.k_hbm, refs.k_buf), (refs.v_hbm, refs.v_buf)):
            action(pltpu.make_async_copy(pages.at[physical], buf.at[self.slot, dst], refs.sems.at[self.slot]))


def _table_copy(refs: _Refs, cfg: _Config, row: jax.Array) -> Any:
    """The DMA of a row's sequence's page table from HBM into the row's SMEM slot. Mosaic copies 1-D SMEM in
    whole tiles, so the tables come padded to whole tiles (table_stride) and each copy moves one padded table."""
    stride = cfg.table_stride
    table = refs.tables_hbm.at[pl.ds(pl.multiple_of(refs.seq[row] * stride, _SMEM_TILE), stride)]
    slot = refs.tables.at[pl.ds(pl.multiple_of((row % 2) * stride, _SMEM_TILE), stride)]
    return pltpu.make_async_copy(table, slot, refs.table_sem)


def _attend_block(refs: _Refs, cfg: _Config, kv_head: int, block: jax.Array, slot: jax.Array, row: jax.Array) -> None:
    """Fold one KV block into the online softmax of one kv head's M query rows."""
    first_pos, num_queries = refs.first_pos[row], refs.num_queries[row]
    q = refs.q[kv_head]  # [M, head_dim]
    # Head kv_head of each token: one sublane of each token's (kv_heads, head_dim) tile, a strided load on TPU.
    k = refs.k_buf[slot, :, kv_head, :].astype(q.dtype)  # [block_kv, head_dim]
    v = refs.v_buf[slot, :, kv_head, :].astype(q.dtype)

    # Pages outside the row's kv span were not copied and may hold anything, NaNs included. Their scores
    # are masked below; their values are zeroed, since 0 * NaN would poison the accumulator.
    lo, hi = _kv_span(first_pos, num_queries, cfg.sliding_window)
    v_pos = block * cfg.block_kv + jax.lax.broadcasted_iota(jnp.int32, v.shape, 0)
    v = jnp.where((v_pos >= lo) & (v_pos < hi), v, jnp.zeros_like(v))

    scores = jax.lax.dot_general(q, k, (((1,), (1,)), ((), ())), preferred_element_type=jnp.float32) * cfg.scale
    if cfg.soft_cap is not None:
        scores = cfg.soft_cap * jnp.tanh(scores / cfg.soft_cap)
    query = jax.lax.broadcasted_iota(jnp.int32, scores.shape, 0) // cfg.group  # M is query-major
    q_pos = first_pos + query
    kv_pos = block * cfg.block_kv + jax.lax.broadcasted_iota(jnp.int32, scores.shape, 1)
    mask = (query < num_queries) & (kv_pos <= q_pos)
    if cfg.sliding_window is not None:
        mask &= kv_pos > q_pos - cfg.sliding_window
    scores = jnp.where(mask, scores, MASK_VALUE)

    m_prev, l_prev = refs.running_max[kv_head, :, :1], refs.denom[kv_head, :, :1]  # [M, 1]
    m_new = jnp.maximum(m_prev, scores.max(axis=1, keepdims=True))
    probs = jnp.where(mask, jnp.exp(scores - m_new), 0.0)  # exact zeros where all is masked so far
    correction = jnp.exp(m_prev - m_new)
    l_new = correction * l_prev + probs.sum(axis=1, keepdims=True)
    update = jnp.dot(probs.astype(v.dtype), v, preferred_element_type=jnp.float32)
    refs.acc[kv_head] = correction * refs.acc[kv_head] + update
    refs.running_max[kv_head] = jnp.broadcast_to(m_new, refs.running_max.shape[1:])
    refs.denom[kv_head] = jnp.broadcast_to(l_new, refs.denom.shape[1:])


def _kernel(*operands: Any, cfg: _Config) -> None:
    """One grid step: attention of one row's queries to its sequence's visible KV blocks."""
    refs = _Refs(*operands)
    row, num_rows = pl.program_id(0), pl.num_programs(0)

    def blocks_of(r: jax.Array) -> tuple[jax.Array, jax.Array]:
        return _block_span(refs.first_pos[r], refs.num_queries[r], cfg)

    first_block, end_block = blocks_of(row)
    prev_first, prev_end = blocks_of(jnp.maximum(row - 1, 0))
    next_row = jnp.minimum(row + 1, num_rows - 1)
    next_first, next_end = blocks_of(next_row)
    has_blocks, prev_has_blocks = end_block > first_block, (row > 0) & (prev_end > prev_first)
    next_has_blocks = (row + 1 < num_rows) & (next_end > next_first)

    # A row's page table is copied only if the row has blocks: started as the previous row begins (row 0's
    # by itself), waited for just before its first K/V block's copy starts. The previous row starts that
    # copy at its last block, unless it had no blocks to overlap it with.
    @pl.when(has_blocks & (row == 0))
    def _():
        _table_copy(refs, cfg, row).start()

    @pl.when(has_blocks & ~prev_has_blocks)
    def _():
        _table_copy(refs, cfg, row).wait()
        _BlockCopy(refs, cfg, row, first_block, refs.first_slot[row]).start()

    # The next row's table goes into the other slot, which the previous row has finished with.
    @pl.when(next_has_blocks)
    def _():
        _table_copy(refs, cfg, next_row).start()

    refs.running_max[...] = jnp.full(refs.running_max.shape, MASK_VALUE, jnp.float32)
    refs.denom[...] = jnp.zeros(refs.denom.shape, jnp.float32)
    refs.acc[...] = jnp.zeros(refs.acc.shape, jnp.float32)

    @pl.loop(first_block, end_block)
    def _(block):
        slot = (refs.first_slot[row] + block - first_block) % 2

        @pl.when(block + 1 < end_block)
        def _():
            _BlockCopy(refs, cfg, row, block + 1, 1 - slot).start()

        @pl.when((block + 1 == end_block) & next_has_blocks)
        def _():
            _table_copy(refs, cfg, next_row).wait()
            _BlockCopy(refs, cfg, next_row, next_first, 1 - slot).start()

        _BlockCopy(refs, cfg, row, block, slot).wait()
        for kv_head in range(refs.q.shape[0]):
            _attend_block(refs, cfg, kv_head, block, slot, row)

    denom = refs.denom[:, :, :1]
    refs.out[...] = (refs.acc[...] / jnp.where(denom > 0, denom, 1.0)).astype(refs.out.dtype)


def _attend_rows(
    q: jax.Array,
    k_pages: jax.Array,
    v_pages: jax.Array,
    page_tables: jax.Array,
    rows: _Rows,
    cfg: _Config,
    interpret: bool,
) -> tuple[jax.Array, jax.Array]:
    """-> (outputs [R * queries_per_row, heads, head_dim], their token indices, num_tokens for none)."""
    num_tokens, num_heads, head_dim = q.shape
    kv_heads = num_heads // cfg.group
    num_rows, per_row = rows.seq.shape[0], cfg.queries_per_row
    rows_shape = (num_rows, kv_heads, per_row * cfg.group, head_dim)
    in_row = jnp.arange(per_row)
    tokens = jnp.where(in_row < rows.num_queries[:, None], rows.first_token[:, None] + in_row, num_tokens)
    q_rows = q.at[tokens].get(mode="fill", fill_value=0)  # [R, per_row, heads, head_dim]
    q_rows = q_rows.reshape(num_rows, per_row, kv_heads, cfg.group, head_dim).transpose(0, 2, 1, 3, 4)

    # TPU layout: the block's last two dims (M, head_dim) are the array's full dims, legal for any M.
    row_spec = pl.BlockSpec((pl.Squeezed(), *rows_shape[1:]), lambda r, *_: (r, 0, 0, 0))
    hbm = pl.BlockSpec(memory_space=pl.ANY)
    kv_buf = pltpu.VMEM((2, cfg.block_kv, kv_heads, head_dim), k_pages.dtype)
    stats = pltpu.VMEM((*rows_shape[1:3], _LANES), jnp.float32)
    out = pl.pallas_call(
        functools.partial(_kernel, cfg=cfg),
        out_shape=jax.ShapeDtypeStruct(rows_shape, q.dtype),
        grid_spec=pltpu.PrefetchScalarGridSpec(
            num_scalar_prefetch=_ROW_FIELDS,
            grid=(num_rows,),
            in_specs=[hbm, row_spec, hbm, hbm],
            out_specs=row_spec,
            scratch_shapes=[
                pltpu.SMEM((2 * cfg.table_stride,), jnp.int32),
                pltpu.SemaphoreType.DMA(()),
                kv_buf,
                kv_buf,
                pltpu.SemaphoreType.DMA((2,)),
                stats,
                stats,
                pltpu.VMEM(rows_shape[1:], jnp.float32),
            ],
        ),
        # Sequential: each row prefetches the next row's first KV block.
        compiler_params=pltpu.CompilerParams(dimension_semantics=("arbitrary",)),
        interpret=pltpu.InterpretParams() if interpret else False,
        name="ragged_paged_attention",
    )(
        rows.seq,
        rows.first_pos,
        rows.num_queries,
        rows.first_slot,
        # 1-D, as the SMEM slots its rows are copied into, each table padded to whole SMEM tiles
        jnp.pad(page_tables, ((0, 0), (0, cfg.table_stride - cfg.max_pages))).reshape(-1),
        q_rows.reshape(rows_shape),
        k_pages,
        v_pages,
    )
    out = out.reshape(num_rows, kv_heads, per_row, cfg.group, head_dim).transpose(0, 2, 1, 3, 4)
    return out.reshape(num_rows * per_row, num_heads, head_dim), tokens.reshape(-1)


@functools.partial(
    jax.jit, static_argnames=("scale", "sliding_window", "soft_cap", "interpret", "block_q", "pages_per_block")
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
    interpret: bool = False,
    block_q: int = BLOCK_Q,
    pages_per_block: int = 8,
) -> jax.Array:
    """q [T, heads, head_dim] attending to its sequences' (already written) pages -> [T, heads, head_dim].

    k_pages, v_pages: [num_pages, page_size, kv_heads, head_dim]; context_lens [S], page_tables
    [S, max_pages] and query_start_loc [S + 1] as in `jserve.attention.AttentionMetadata`. Padding query
    tokens give zeros. block_q: queries per prefill row; pages_per_block: KV pages per DMA'd block.
    """
    num_tokens, num_heads, head_dim = q.shape
    _, page_size, kv_heads, kv_head_dim = k_pages.shape
    num_seqs, max_pages = page_tables.shape
    if num_heads % kv_heads or kv_head_dim != head_dim or v_pages.shape != k_pages.shape:
        raise ValueError(f"incompatible shapes: q {q.shape}, k_pages {k_pages.shape}, v_pages {v_pages.shape}")
    if block_q < 1 or pages_per_block < 1:
        raise ValueError(f"block sizes must be positive, got {block_q=}, {pages_per_block=}")

    q_lens = query_start_loc[1:] - query_start_loc[:-1]
    out = jnp.zeros(q.shape, q.dtype)
    decodes, prefills = _row_groups(num_tokens, num_seqs, block_q)
    for selected, (per_row, num_rows) in ((q_lens == 1, decodes), (q_lens > 1, prefills)):
        if num_rows == 0:
            continue
        cfg = _Config(
            queries_per_row=per_row,
            group=num_heads // kv_heads,
            page_size=page_size,
            pages_per_block=min(pages_per_block, max_pages),
            max_pages=max_pages,
            scale=scale,
            sliding_window=sliding_window,
            soft_cap=soft_cap,
        )
        rows = _query_rows(query_start_loc, context_lens, selected, num_rows, cfg)

        def add_rows(out: jax.Array, rows: _Rows, cfg: _Config = cfg) -> jax.Array:
            rows_out, tokens = _attend_rows(q, k_pages, v_pages, page_tables, rows, cfg, interpret)
            return out.at[tokens].set(rows_out, mode="drop")

        # Rows with work come first: a group without any (no decodes, or no prefills) costs nothing.
        out = jax.lax.cond(rows.num_queries[0] > 0, add_rows, lambda out, rows: out, out, rows)
    return out
