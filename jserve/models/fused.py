"""Fused projections: the checkpoint's projections of one input (q/k/v, gate/up) held as one weight, so a
layer runs two matmuls where it ran five. On a CPU each of XLA's matmuls also costs ~2 ms on an executable's
first run, whatever its size, and wider ones measured faster at 16 tokens (docs/benchmarks.md).

The fused weight stacks its pieces' rows. With tensor parallelism over `shards` devices, each holding one
block of rows, the rows go shard by shard, [q₀ k₀ v₀ | q₁ k₁ v₁ | …]: every device's block holds its own
heads of each piece, so splitting the output is local.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np


def fuse(pieces: Sequence[np.ndarray], shards: int, axis: int = 0, concatenate=np.concatenate) -> np.ndarray:
    """Checkpoint pieces (weights [rows, in], biases [rows], or stacked experts' [experts, rows, in]) -> the
    fused array, rows (along `axis`) shard by shard. `concatenate`: jnp.concatenate fuses jax arrays (in a
    step: low_rank.py)."""
    before = pieces[0].shape[:axis]
    blocks = [piece.reshape(*before, shards, -1, *piece.shape[axis + 1 :]) for piece in pieces]
    return concatenate(blocks, axis=axis + 1).reshape(*before, -1, *pieces[0].shape[axis + 1 :])


def split(fused, widths: Sequence[int], shards: int, axis: int) -> list:
    """The pieces of a fused numpy or jax array along `axis`: a weight's rows (0) or a matmul's outputs (-1).
    `widths`: each piece's rows."""
    axis %= fused.ndim
    before, after = fused.shape[:axis], fused.shape[axis + 1 :]
    blocks = fused.reshape(*before, shards, -1, *after)
    pieces, start = [], 0
    for width in widths:
        index = (slice(None),) * (axis + 1) + (slice(start, start + width // shards),)
        pieces.append(blocks[index].reshape(*before, width, *after))
        start += width // shards
    return pieces
