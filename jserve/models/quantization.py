"""int8 weights (one scale per output channel) times activations written as two int8 digits per token.

The weight is int8 with a float32 scale per output row. Each activation row x is split, at run time, into
a coarse int8 row and an int8 row of what the coarse one missed (each with its own scale): x ≈ s1·q1 + s2·q2,
good to about 14 bits, so activations add no measurable error and int8 weights are the only approximation.
Both digits go through one int8 × int8 → int32 matmul (the int8 units: AMX / VNNI on CPU, int8 tensor
cores on GPU), which reads the weight once. On this project's CPU that runs 2-3x faster than float32 at
batch 64-512 and 6-9x faster for the LM head, and reads a quarter of the weight bytes. One-digit
activations would be twice as fast again but measured 3x the logit error on SmolLM2 (docs/benchmarks.md).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

QUANTIZATIONS = ("none", "int8")


def quantize_rows(w: jax.Array) -> tuple[jax.Array, jax.Array]:
    """Symmetric int8 along the last axis: (int8 values, float32 scale per row) with w ≈ q * scale."""
    w = w.astype(jnp.float32)
    scale = jnp.max(jnp.abs(w), axis=-1) / 127.0
    q = jnp.round(w / jnp.where(scale == 0, 1.0, scale)[..., None])
    return q.astype(jnp.int8), scale


def int8_matmul(x: jax.Array, q: jax.Array, scale: jax.Array) -> jax.Array:
    """x [..., in] times the int8 weight q [out, in] (per-row `scale`) -> [..., out] in x's dtype."""
    lead, width = x.shape[:-1], x.shape[-1]
    rows = x.reshape(-1, width).astype(jnp.float32)
    coarse, coarse_scale = quantize_rows(rows)
    fine, fine_scale = quantize_rows(rows - coarse * coarse_scale[:, None])
    acc = jax.lax.dot_general(
        jnp.concatenate([coarse, fine]), q, (((1,), (1,)), ((), ())), preferred_element_type=jnp.int32
    ).astype(jnp.float32)
    n = rows.shape[0]
    y = (acc[:n] * coarse_scale[:, None] + acc[n:] * fine_scale[:, None]) * scale
    return y.reshape(*lead, q.shape[0]).astype(x.dtype)
