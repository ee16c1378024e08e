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

from dataclasses import dataclass, field

import jax
import jax.numpy as jnp

from jserve import cpu_kernels

QUANTIZATIONS = ("none", "int8")
# On a lone CPU device with AVX-512 VNNI, the C++ kernel runs every int8 projection, quantizing x itself:
# 1.3-2.8x faster than XLA's ops from 1 to 512 tokens (docs/benchmarks.md). False runs XLA's everywhere
# (benchmarks compare the two).
CPU_KERNEL = True


def quantize_rows(w: jax.Array) -> tuple[jax.Array, jax.Array]:
    """Symmetric int8 along the last axis: (int8 values, float32 scale per row) with w ≈ q * scale."""
    w = w.astype(jnp.float32)
    scale = jnp.max(jnp.abs(w), axis=-1) / 127.0
    q = jnp.round(w / jnp.where(scale == 0, 1.0, scale)[..., None])
    return q.astype(jnp.int8), scale


@jax.tree_util.register_dataclass
@dataclass(frozen=True)
class Int8Activations:
    """Rows of x as two int8 digits: digits [2N, in] (the N coarse rows, then the N fine ones), scales [2N]."""

    digits: jax.Array
    scales: jax.Array
    lead: tuple[int, ...] = field(metadata=dict(static=True))  # x's leading shape
    dtype: jnp.dtype = field(metadata=dict(static=True))


def quantize_activations(x: jax.Array) -> Int8Activations:
    """Done once per input, and shared by every projection of that input (q/k/v, gate/up)."""
    rows = x.reshape(-1, x.shape[-1]).astype(jnp.float32)
    coarse, coarse_scale = quantize_rows(rows)
    fine, fine_scale = quantize_rows(rows - coarse * coarse_scale[:, None])
    return Int8Activations(
        jnp.concatenate([coarse, fine]), jnp.concatenate([coarse_scale, fine_scale]), x.shape[:-1], x.dtype
    )


def prepare_activations(x: jax.Array) -> jax.Array | Int8Activations:
    """x as the projections of one input (q/k/v, gate/up) share it: quantized once for XLA's dot; as it is
    for the C++ kernel, which quantizes inside."""
    return x if _takes_cpu_kernel() else quantize_activations(x)


def int8_matmul(x: jax.Array | Int8Activations, q: jax.Array, scale: jax.Array) -> jax.Array:
    """x [..., in] times the int8 weight q [out, in] (per-row `scale`) -> [..., out] in x's dtype."""
    if not isinstance(x, Int8Activations):
        if _takes_cpu_kernel():
            y = cpu_kernels.int8_linear(x.reshape(-1, x.shape[-1]).astype(jnp.float32), q, scale)
            return y.reshape(*x.shape[:-1], q.shape[0]).astype(x.dtype)
        x = quantize_activations(x)
    acc = jax.lax.dot_general(x.digits, q, (((1,), (1,)), ((), ())), preferred_element_type=jnp.int32)
    acc = acc.astype(jnp.float32) * x.scales[:, None]
    n = acc.shape[0] // 2
    y = (acc[:n] + acc[n:]) * scale
    return y.reshape(*x.lead, q.shape[0]).astype(x.dtype)


def _takes_cpu_kernel() -> bool:
    """On a lone CPU device only: with several, the weight may be sharded, and XLA cannot split a custom call."""
    return (
        CPU_KERNEL
        and jax.default_backend() == "cpu"
        and jax.device_count() == 1
        and cpu_kernels.int8_linear_available()
    )
