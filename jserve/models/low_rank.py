"""Low-rank deltas of many adapters applied per token in one batch (LoRA: y += B·A·x for the token's adapter).

Every adapter slot's A and B sit stacked in fixed-shape arrays (rank padded to the maximum, the scale folded
into B, an empty slot all zeros), and each token names its slot (-1: the base model). A step multiplies the
tokens by every slot's A, zeroes the columns of slots other than each token's own, and multiplies by every
slot's B: two dense matmuls whose inner size is slots × rank, exact per token, without gathering weights per
token, and the same shapes whatever adapters come and go (nothing recompiles).

A fused projection (q/k/v, gate/up: fused.py) has one A and one B per piece: its A stacks the pieces' rows,
and each piece's B multiplies that piece's columns only, so no work goes to the zero blocks between pieces.

On a CPU (one device, jserve's kernels built) the two products run in a C++ kernel instead
(cpu_kernels/lora.cc), which computes each token's own slot only and reads only the slots the step uses:
XLA's small-batch matmuls read every slot's weights at a few GB/s, which cost more than the base model's
own projections.
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import partial

import jax
import jax.numpy as jnp

from jserve import cpu_kernels
from jserve.models import fused
from jserve.models.norm import RMSNorm


@jax.tree_util.register_dataclass
@dataclass(frozen=True)
class LowRank:
    """One projection's adapters: `a` [slots, pieces × rank, in], `b` per piece [slots, rank, rows] (scaled):
    each product's contracted axes adjacent (no transpose a step), and B's rows contiguous, so the CPU
    kernel's expansion runs along them in vectors."""

    a: jax.Array
    b: tuple[jax.Array, ...]


@dataclass(frozen=True)
class SlotWeights:
    """Every slot's weights: per layer, each adapted projection's LowRank by name (qkv_proj, o_proj,
    gate_up_proj, down_proj). `cpu_kernel` (static): on a CPU, run the products in jserve's kernel."""

    layers: tuple[dict[str, LowRank], ...]
    cpu_kernel: bool = False


jax.tree_util.register_dataclass(SlotWeights, data_fields=["layers"], meta_fields=["cpu_kernel"])


@jax.tree_util.register_dataclass
@dataclass(frozen=True)
class Adapters:
    """What a step's layers read of the adapters: each token's slot, and every slot's weights."""

    token_slots: jax.Array  # [T] int32, -1: no adapter
    weights: SlotWeights

    def layer(self, index: int) -> LayerAdapters:
        return LayerAdapters(self.token_slots, self.weights.layers[index], self.weights.cpu_kernel)


@dataclass(frozen=True)
class LayerAdapters:
    token_slots: jax.Array
    projections: dict[str, LowRank]
    cpu_kernel: bool

    def get(self, projection: str) -> Delta | None:
        weights = self.projections.get(projection)
        return None if weights is None else Delta(weights, self.token_slots, self.cpu_kernel)


jax.tree_util.register_dataclass(LayerAdapters, data_fields=["token_slots", "projections"], meta_fields=["cpu_kernel"])


@dataclass(frozen=True)
class Delta:
    """One projection's low-rank update for a step's tokens (Linear adds it to its output)."""

    weights: LowRank
    token_slots: jax.Array
    cpu_kernel: bool = False

    def add_to(self, y: jax.Array, x: jax.Array, norm: RMSNorm | None = None, shards: int = 1) -> jax.Array:
        """y [T, rows] (the projection's output; a fused one's pieces in its row order) plus the delta of its
        input, norm(x) or x [T, in]."""
        if not self.cpu_kernel or y.dtype != jnp.float32:
            return self._masked(y, x, norm, shards)
        # (chosen by the platform the step is lowered for: a CPU host can lower an accelerator's step)
        kernel, masked = partial(self._kernel, norm=norm), partial(self._masked, norm=norm, shards=shards)
        return jax.lax.platform_dependent(y, x, cpu=kernel, default=masked)

    def _masked(self, y: jax.Array, x: jax.Array, norm: RMSNorm | None, shards: int) -> jax.Array:
        """Every slot's products, each token's own slot kept: XLA's matmuls, on any device and sharding."""
        x = x if norm is None else norm(x)
        a, pieces = self.weights.a, self.weights.b
        slots, rank = a.shape[0], a.shape[1] // len(pieces)
        xa = jnp.einsum("ti,swi->tsw", x, a.astype(x.dtype))
        own = self.token_slots[:, None] == jnp.arange(slots, dtype=self.token_slots.dtype)[None, :]
        xa = jnp.where(own[:, :, None], xa, 0)
        outs = [
            jnp.einsum("tsr,sro->to", xa[:, :, p * rank : (p + 1) * rank], b.astype(x.dtype))
            for p, b in enumerate(pieces)
        ]
        delta = outs[0] if len(outs) == 1 else fused.fuse(outs, shards, axis=1, concatenate=jnp.concatenate)
        return y + delta.astype(y.dtype)

    def _kernel(self, y: jax.Array, x: jax.Array, norm: RMSNorm | None) -> jax.Array:
        """Each token's own slot only, added into y in place by jserve's C++ kernel (one device: each piece's
        columns are one block of y's), which applies the norm to the rows of tokens with an adapter."""
        a, pieces, slots = self.weights.a, self.weights.b, self.token_slots
        rank = a.shape[1] // len(pieces)
        xa = cpu_kernels.lora_shrink(x, slots, a, None if norm is None else norm.params)
        offset = 0
        for p, b in enumerate(pieces):
            y = cpu_kernels.lora_expand(y, xa[:, p * rank : (p + 1) * rank], slots, b, offset)
            offset += b.shape[2]
        return y
