"""Grouped matmul for NVIDIA GPUs (a mixture of experts' projections): a Pallas kernel lowered through Triton.

Rows sorted by group times each group's own weight. XLA:GPU has no grouped GEMM of its own: by default its
RaggedDotRewriter turns `ragged_dot` into one dense GEMM over every row broadcast to every group and masked,
G times the FLOPs through a [rows, G, in] temporary, after transposing the layer's stacked expert weights
(for Qwen3-30B-A3B's 128 experts, 1.2 GB of weights a layer every step, and at 256 tokens a step 1.5 GB of
broadcast rows). Here the rows are cut into tiles of `block_m`; one
program multiplies one (tile, group) pair that shares rows by one block of `block_n` outputs of that group's
weight, `block_k` inputs at a time, and stores only its group's rows. A step reads each routed expert's
weight once per tile its rows touch, and never the experts no row chose.

int8 weights (a float32 scale per output) are widened to the rows' dtype block by block inside the kernel
and scaled at the end: they cross memory as int8 and multiply exactly (|q| <= 127 is exact in bfloat16).

`gated`: the weight is a gated MLP's fused gate and up projections (gate's outputs, then up's), and a program
computes a block of both and stores act(gate) * up: an expert MLP's first half in one kernel, whose output
is half as wide, with no [rows, 2 * inner] product written and read back between kernels.

The rows need not fill the last tile: loads past them are masked (read as zeros) and stores too, so the
step pads and slices nothing around the kernel.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plt

MIN_DOT = 16  # Triton's dot wants every dimension >= 16


@dataclass(frozen=True)
class GroupedLaunch:
    """How the kernel is launched. Not yet measured on a GPU: `benchmarks/grouped_matmul.py --tune` searches
    these there. Each block is a power of two, cut to what the rows and the weight allow (`_block`).

    A visit reads its expert's weight block whole, and there are about (row tiles + experts) visits, so
    larger row tiles read the weights fewer times: a visit's products cost less than its reads until a
    tile holds about 200 rows on an H100 or H200 (bf16 tensor-core FLOP/s over HBM bytes/s)."""

    block_m: int = 64  # rows a tile holds (fewer rows: the next power of two >= them, >= MIN_DOT)
    block_n: int = 64  # outputs a program computes
    block_k: int = 64  # inputs it reads at a time
    num_warps: int = 4
    num_stages: int = 2  # Triton's software pipelining of the loads


def supports(in_features: int, out_features: int, gated: bool = False) -> bool:
    """Whether the kernel takes weights [G, out, in]: both sizes (gated: each half of out) multiples of MIN_DOT
    (blocks divide them)."""
    halves = 2 if gated else 1
    return in_features % MIN_DOT == 0 and out_features % (halves * MIN_DOT) == 0


def row_block(rows: int, most: int) -> int:
    """Rows a tile holds: `most`, or for fewer rows the next power of two >= them (at least MIN_DOT)."""
    return min(most, max(MIN_DOT, pl.next_power_of_2(rows)))


def grouped_matmul(
    x: jax.Array,
    w: jax.Array,
    group_sizes: jax.Array,
    scale: jax.Array | None = None,
    *,
    gated: str | None = None,
    launch: GroupedLaunch = GroupedLaunch(),
    interpret: bool = False,
) -> jax.Array:
    """x [M, in], its rows sorted by group; w [G, out, in] (int8 with `scale` float32 [G, out], or x's float
    type); group_sizes int32 [G], sum <= M: rows past the last group are padding and come back as zeros.
    -> [M, out] in x's dtype; `gated` ("silu" or "gelu_tanh"): w's outputs are gate's then up's, and the
    result is act(gate) * up, [M, out / 2]."""
    rows, in_features = x.shape
    groups, out_features, _ = w.shape
    if not supports(in_features, out_features, gated is not None):
        raise ValueError(f"grouped_matmul needs in and out features multiples of {MIN_DOT}, got {w.shape}")
    if gated not in (None, "silu", "gelu_tanh"):
        raise ValueError(f"gated: 'silu' or 'gelu_tanh', got {gated!r}")
    outputs = out_features // 2 if gated else out_features
    block_m = row_block(rows, launch.block_m)
    block_n, block_k = _block(outputs, launch.block_n), _block(in_features, launch.block_k)
    kernel = functools.partial(_kernel, groups=groups, block_m=block_m, block_n=block_n, block_k=block_k,
                               gated=gated)  # fmt: skip
    scales = () if scale is None else (scale,)
    return pl.pallas_call(
        kernel,
        out_shape=jax.ShapeDtypeStruct((rows, outputs), x.dtype),
        # every (tile, group) pair that can share rows: each group boundary inside a tile adds one
        grid=(pl.cdiv(rows, block_m) + groups, outputs // block_n),
        interpret=interpret,
        compiler_params=plt.CompilerParams(num_warps=launch.num_warps, num_stages=launch.num_stages),
        name="grouped_matmul",
    )(group_sizes.astype(jnp.int32), x, w, *scales)


def _block(features: int, most: int) -> int:
    """The largest power of two <= `most` (and >= MIN_DOT) dividing `features` (a multiple of MIN_DOT)."""
    return max(MIN_DOT, min(most, features & -features))


def _kernel(
    sizes_ref,  # [groups] int32: the groups' rows
    x_ref,  # [M, in]
    w_ref,  # [groups, out, in]
    *refs,  # (scale [groups, out],) out [M, out] (gated: [M, out / 2])
    groups: int,
    block_m: int,
    block_n: int,
    block_k: int,
    gated: str | None,
):
    *scale_ref, out_ref = refs
    visit, column_block = pl.program_id(0), pl.program_id(1)
    # One slot more than the groups, for the padding rows; a power of two, as Triton's vectors are (read
    # as zeros past the groups: nothing pads the sizes before the kernel).
    slot = jnp.arange(pl.next_power_of_2(groups + 1))
    sizes = plt.load(sizes_ref.at[pl.ds(0, slot.shape[0])], mask=slot < groups, other=0)
    group, first_row, mine, count = find_visit(sizes, visit, groups, block_m, x_ref.shape[0])

    @pl.when(visit < count)
    def _():
        rows = pl.ds(first_row, block_m)
        in_rows = (first_row + jnp.arange(block_m) < x_ref.shape[0])[:, None]  # (the last tile's may end early)
        # the output block's weight rows: gated, gate's block and up's (half the outputs on)
        halves = (0, out_ref.shape[1]) if gated else (0,)
        columns = [pl.ds(half + column_block * block_n, block_n) for half in halves]
        weight = jnp.minimum(group, groups - 1)  # (the padding rows read no weight: their loop runs 0 times)

        def accumulate(step, accs):
            inputs = pl.ds(step * block_k, block_k)
            x = plt.load(x_ref.at[rows, inputs], mask=in_rows, other=0)
            products = [_dot(x, w_ref[weight, c, inputs].astype(x.dtype).T) for c in columns]
            return tuple(acc + product for acc, product in zip(accs, products, strict=True))

        steps = (group < groups).astype(jnp.int32) * (x_ref.shape[1] // block_k)
        zeros = tuple(jnp.zeros((block_m, block_n), jnp.float32) for _ in columns)
        accs = jax.lax.fori_loop(jnp.int32(0), steps, accumulate, zeros)
        if scale_ref:
            accs = tuple(acc * scale_ref[0][weight, c][None, :] for acc, c in zip(accs, columns, strict=True))
        out = _activation(accs[0], gated) * accs[1] if gated else accs[0]
        plt.store(out_ref.at[rows, columns[0]], out.astype(out_ref.dtype), mask=mine[:, None])


def _activation(gate: jax.Array, name: str) -> jax.Array:
    return jax.nn.gelu(gate, approximate=True) if name == "gelu_tanh" else jax.nn.silu(gate)


def find_visit(sizes, visit, groups: int, block_m: int, rows: int):
    """Visit `visit`'s (group, first row of its tile, which of the tile's rows [block_m] are the group's) and
    how many visits there are, for `rows` rows and group sizes [S]. Visits run group by group, each over the
    tiles its rows touch; the rows past the groups are one more group (`groups`), whose visits store zeros.
    Computed by every program from the sizes (a few vector operations on S integers), so the step launches no
    kernels to plan the visits."""
    slot = jnp.arange(sizes.shape[0])
    sizes = jnp.where(slot == groups, rows - jnp.sum(sizes), sizes)
    ends = jnp.cumsum(sizes)
    starts = ends - sizes
    first_tile = starts // block_m
    visits = jnp.where(sizes > 0, (ends - 1) // block_m - first_tile + 1, 0)
    visits_to = jnp.cumsum(visits)  # visits of the groups up to and including each
    group = jnp.sum((visits_to <= visit).astype(jnp.int32))

    def of_group(values):
        return jnp.sum(jnp.where(slot == group, values, 0))

    first_row = (of_group(first_tile) + visit - of_group(visits_to - visits)) * block_m
    row = first_row + jnp.arange(block_m)
    mine = (row >= of_group(starts)) & (row < of_group(ends))
    return group, first_row, mine, jnp.sum(visits)


def _dot(a: jax.Array, b: jax.Array) -> jax.Array:
    """float32-accumulated matmul; float32 inputs keep full precision (no TF32)."""
    precision = jax.lax.Precision.HIGHEST if a.dtype == jnp.float32 else None
    return jnp.dot(a, b, preferred_element_type=jnp.float32, precision=precision)
