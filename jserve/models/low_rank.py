"""Low-rank deltas of many adapters applied per token in one batch (LoRA: y += B·A·x for the token's adapter).

Every adapter slot's A and B sit stacked in fixed-shape arrays (rank padded to the maximum, the scale folded
into B, an empty slot all zeros), and each token names its slot (-1: the base model). A step multiplies the
tokens by every slot's A, zeroes the columns of slots other than each token's own, and multiplies by every
slot's B: two dense matmuls whose inner size is slots × rank, exact per token, without gathering weights per
token, and the same shapes whatever adapters come and go (nothing recompiles).

A fused projection (q/k/v, gate/up: fused.py) has one A and one B per piece: its A stacks the pieces' rows,
and each piece's B multiplies that piece's columns only, so no work goes to the zero blocks between pieces.
"""

from __future__ import annotations

from dataclasses import dataclass

import jax
import jax.numpy as jnp

from jserve.models import fused


@jax.tree_util.register_dataclass
@dataclass(frozen=True)
class LowRank:
    """One projection's adapters: `a` [slots, pieces × rank, in], `b` per piece [rows, slots, rank] (scaled).
    Both keep the contracted axes last, as the base weight's [out, in] does: the matmuls read them in place."""

    a: jax.Array
    b: tuple[jax.Array, ...]


@jax.tree_util.register_dataclass
@dataclass(frozen=True)
class Adapters:
    """What a step's layers read of the adapters: each token's slot, and each layer's projections' LowRank
    by projection name (qkv_proj, o_proj, gate_up_proj, down_proj)."""

    token_slots: jax.Array  # [T] int32, -1: no adapter
    layers: tuple[dict[str, LowRank], ...]

    def layer(self, index: int) -> LayerAdapters:
        return LayerAdapters(self.token_slots, self.layers[index])


@jax.tree_util.register_dataclass
@dataclass(frozen=True)
class LayerAdapters:
    token_slots: jax.Array
    projections: dict[str, LowRank]

    def get(self, projection: str) -> Delta | None:
        weights = self.projections.get(projection)
        return None if weights is None else Delta(weights, self.token_slots)


@dataclass(frozen=True)
class Delta:
    """One projection's low-rank update for a step's tokens (Linear adds it to its output)."""

    weights: LowRank
    token_slots: jax.Array

    def __call__(self, x: jax.Array, shards: int = 1) -> jax.Array:
        """The delta [T, rows] of x [T, in] (a fused projection's pieces fused in its row order)."""
        a, pieces = self.weights.a, self.weights.b
        slots, width = a.shape[0], a.shape[1]
        rank = width // len(pieces)
        xa = jnp.einsum("ti,swi->tsw", x, a.astype(x.dtype))
        own = self.token_slots[:, None] == jnp.arange(slots, dtype=self.token_slots.dtype)[None, :]
        xa = jnp.where(own[:, :, None], xa, 0)
        outs = [
            jnp.einsum("tsr,osr->to", xa[:, :, p * rank : (p + 1) * rank], b.astype(x.dtype))
            for p, b in enumerate(pieces)
        ]
        return outs[0] if len(outs) == 1 else fused.fuse(outs, shards, axis=1, concatenate=jnp.concatenate)
