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

from dataclasses import dataclass

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


def quantize_activations(rows: jax.Array) -> Int8Activations:
    """rows [N, in] as digits; done once per input, and shared by every projection of that input."""
    rows = rows.astype(jnp.float32)
    coarse, coarse_scale = quantize_rows(rows)
    fine, fine_scale = quantize_rows(rows - coarse * coarse_scale[:, None])
    return Int8Activations(jnp.concatenate([coarse, fine]), jnp.concatenate([coarse_scale, fine_scale]))


def int8_matmuls(
    x: jax.Array, weights: list[tuple[jax.Array, jax.Array]], real_rows: jax.Array | None = None
) -> list[jax.Array]:
    """x [..., in] times each int8 weight q [out, in] (per-row scale) -> [..., out] each, in x's dtype. The
    projections of one input (q/k/v, gate/up) share its digits: on CPU one kernel call, else one quantization.
    `real_rows` (int32 [1]): rows of x past it are padding; the CPU kernel skips them (their outputs are
    zeros), XLA's ops compute them anyway."""
    rows = x.reshape(-1, x.shape[-1])
    if _takes_cpu_kernel():
        ys = cpu_kernels.int8_linear(rows.astype(jnp.float32), weights, real_rows)
    else:
        digits = quantize_activations(rows)
        ys = [_xla_int8_matmul(digits, q, scale) for q, scale in weights]
    return [y.reshape(*x.shape[:-1], y.shape[-1]).astype(x.dtype) for y in ys]


def int8_matmul(x: jax.Array, q: jax.Array, scale: jax.Array) -> jax.Array:
    return int8_matmuls(x, [(q, scale)])[0]


def _xla_int8_matmul(x: Int8Activations, q: jax.Array, scale: jax.Array) -> jax.Array:
    acc = jax.lax.dot_general(x.digits, q, (((1,), (1,)), ((), ())), preferred_element_type=jnp.int32)
    acc = acc.astype(jnp.float32) * x.scales[:, None]
    n = acc.shape[0] // 2
    return (acc[:n] + acc[n:]) * scale


def _takes_cpu_kernel() -> bool:
    """On a lone CPU device only: with several, the weight may be sharded, and XLA cannot split a custom call."""
    return (
        CPU_KERNEL
        and jax.default_backend() == "cpu"
        and jax.device_count() == 1
        and cpu_kernels.int8_linear_available()
    )
