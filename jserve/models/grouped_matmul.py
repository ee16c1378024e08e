"""Grouped matmul: rows sorted by group (a mixture of experts' tokens by expert), each group's rows times its
own weight, in fixed shapes and at a cost that grows with the rows, not with rows × groups.

Each platform takes the form that does this there:
- NVIDIA GPUs: a Pallas (Triton) kernel, `pallas_kernels.gpu.grouped_matmul`, for float and int8 weights
  alike. XLA:GPU's own `ragged_dot` multiplies every row by every group's weight (a dense GEMM over the rows
  broadcast to each group, masked: its RaggedDotRewriter), 128x the work for Qwen3-MoE's 128 experts.
- TPUs: XLA's `ragged_dot` for float weights (a grouped kernel of XLA:TPU's own).
- CPUs, and int8 weights off NVIDIA GPUs: the sorted rows walked in tiles. Each (tile, group) pair that shares
  rows is one [tile, in] x [in, out] matmul with the other groups' rows masked out, at most tiles + groups - 1
  of them (jax's ragged_dot on CPU computes every row against every group's weight: 32 experts, ~38x a
  dense matmul of the same rows, measured); int8 weights go through XLA's int8 dot.
"""

from __future__ import annotations

from functools import partial

import jax
import jax.numpy as jnp

from jserve.models.mlp import gated
from jserve.models.quantization import int8_matmul, quantize_groups

TILE_ROWS = 32
# Rows [M, in] against weights [G, out, in] (each group's checkpoint layout), grouped along M.
_DIMENSIONS = jax.lax.RaggedDotDimensionNumbers(
    dot_dimension_numbers=(((1,), (2,)), ((), ())), lhs_ragged_dimensions=[0], rhs_group_dimensions=[0]
)


def grouped_matmul(
    x: jax.Array, w: jax.Array, group_sizes: jax.Array, scale: jax.Array | None = None, activation_group: int = 0
) -> jax.Array:
    """x [M, in], its rows sorted by group; w [G, out, in] (int8 with `scale` [G, out] when quantized, its
    activations in `activation_group`'s scheme); group_sizes int32 [G] with sum <= M: rows past the last
    group are padding and come back as zeros. -> [M, out] in x's dtype."""
    # Chosen by the platform the step is lowered for, so a CPU host can lower an accelerator's step.
    if scale is not None:
        tiled = partial(_tiled, activation_group=activation_group)
        gpu = partial(_gpu, activation_group=activation_group, otherwise=tiled)
        return jax.lax.platform_dependent(x, w, group_sizes, scale, cuda=gpu, default=tiled)
    tiled = partial(_tiled, scale=None, activation_group=0)
    gpu = partial(_gpu, scale=None, activation_group=0, otherwise=_ragged)
    return jax.lax.platform_dependent(x, w, group_sizes, cpu=tiled, cuda=gpu, default=_ragged)


def grouped_gated_matmul(
    x: jax.Array,
    w: jax.Array,
    group_sizes: jax.Array,
    scale: jax.Array | None = None,
    activation_group: int = 0,
    gelu: bool = False,
) -> jax.Array:
    """act(gate) * up of a gated MLP's fused gate and up projections: w [G, 2 * inner, in], gate's outputs
    then up's (as grouped_matmul takes them); act SiLU, or tanh-approximated GELU. -> [M, inner]. On NVIDIA
    GPUs one kernel computes both halves and the product; elsewhere grouped_matmul, then the product."""

    def separately(x, w, group_sizes, scale=None):
        gate, up = jnp.split(grouped_matmul(x, w, group_sizes, scale, activation_group), 2, axis=-1)
        return gated(gate, up, gelu)

    activation = "gelu_tanh" if gelu else "silu"
    gpu = partial(_gpu, activation_group=activation_group, otherwise=separately, gated=activation)
    return jax.lax.platform_dependent(x, w, group_sizes, scale, cuda=gpu, default=separately)


def _ragged(x, w, group_sizes):
    return jax.lax.ragged_dot_general(x, w, group_sizes, _DIMENSIONS)


def _gpu(x, w, group_sizes, scale, activation_group, otherwise, gated: str | None = None):
    """The Pallas kernel (`gated`: its gated form), where its blocks divide the weight (else `otherwise`).
    int8 weights meet the rows as they are (the int8 scheme's two digits approximate them to ~14 bits);
    w8a8's rows are rounded to its digits first, in float32, as its dense projections on GPUs multiply them."""
    # Imported when first traced (Pallas' Triton backend takes ~0.1 s to import: not every `import jserve`).
    from pallas_kernels.gpu import grouped_matmul as kernel

    if not kernel.supports(in_features=w.shape[2], out_features=w.shape[1], gated=gated is not None):
        return otherwise(x, w, group_sizes) if scale is None else otherwise(x, w, group_sizes, scale)
    rows = quantize_groups(x, activation_group) if scale is not None and activation_group else x
    return kernel.grouped_matmul(rows, w, group_sizes, scale, gated=gated).astype(x.dtype)


def _tiled(x, w, group_sizes, scale, activation_group):
    rows, groups, out_features = x.shape[0], w.shape[0], w.shape[1]
    tile = min(TILE_ROWS, -(-rows // 8) * 8)
    tiles = -(-rows // tile)
    x = jnp.pad(x, ((0, tiles * tile - rows), (0, 0)))
    ends = jnp.cumsum(group_sizes)
    starts = ends - group_sizes
    # The tiles each group's rows fall in: group g visits tiles first[g] .. first[g] + visits[g] - 1.
    first = starts // tile
    visits = jnp.where(group_sizes > 0, (ends - 1) // tile - first + 1, 0)
    max_visits = tiles + groups - 1  # each group boundary inside a tile adds one visit
    visit_group = jnp.repeat(jnp.arange(groups), visits, total_repeat_length=max_visits)
    first_visit = jnp.cumsum(visits) - visits
    visit_tile = first[visit_group] + jnp.arange(max_visits) - first_visit[visit_group]
    offsets = jnp.arange(tile)

    def visit(v, y):
        group, start = visit_group[v], visit_tile[v] * tile
        block = jax.lax.dynamic_slice_in_dim(x, start, tile)
        if scale is None:
            product = jax.lax.dot_general(block, w[group], (((1,), (1,)), ((), ())))
        else:
            product = int8_matmul(block, w[group], scale[group], group=activation_group)
        row = start + offsets
        mine = (row >= starts[group]) & (row < ends[group])
        # Each row belongs to one group: adding the masked product to zeros (or to the other groups' zeros) is exact.
        done = jax.lax.dynamic_slice_in_dim(y, start, tile) + jnp.where(mine[:, None], product, 0).astype(y.dtype)
        return jax.lax.dynamic_update_slice_in_dim(y, done, start, 0)

    y = jax.lax.fori_loop(0, visits.sum(), visit, jnp.zeros((tiles * tile, out_features), x.dtype))
    return y[:rows]
