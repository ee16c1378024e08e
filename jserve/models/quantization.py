"""int8 weights (one scale per output channel) times int8 activations, in two schemes.

The weight is int8 with a float32 scale per output row. `--quantization int8` splits each activation row x,
at run time, into a coarse int8 row and an int8 row of what the coarse one missed (each with its own
scale): x ≈ s1·q1 + s2·q2, good to about 14 bits, so activations add no measurable error and int8 weights
are the only approximation. Both digits go through one int8 × int8 → int32 matmul (the int8 units: AMX /
VNNI on CPU, int8 tensor cores on GPU), which reads the weight once. On this project's CPU that runs 2-3x
faster than float32 at batch 64-512 and 6-9x faster for the LM head, and reads a quarter of the weight
bytes. `--quantization w8a8` writes one int8 digit per input with a scale per 32 inputs (llama.cpp's Q8
blocks): half the multiply-adds, for logits a little further from float32's and greedy replies that part
from float32's sooner (docs/benchmarks.md).
"""

from __future__ import annotations

from dataclasses import dataclass
from enum import StrEnum

import jax
import jax.numpy as jnp

from jserve import cpu_kernels
from jserve.models.norm import rms_norm

GROUP = 32  # w8a8's inputs per activation scale
TILE = (16, 4)  # outputs x inputs per tile line (cpu_kernels/int8_linear.cc); inputs padded to GROUP


class Quantization(StrEnum):
    """`--quantization`: float weights, or int8 ones meeting activations in one of two schemes."""

    NONE = "none"
    INT8 = "int8"  # activations as two int8 digits per row
    W8A8 = "w8a8"  # activations as one int8 digit per GROUP inputs
    GGUF = "gguf"  # a GGUF file's block-format weights kept as they are (loader/gguf_blocks.py), float activations

    @property
    def quantized(self) -> bool:
        """Whether jserve quantizes the weights to int8 (int8, w8a8)."""
        return self in (Quantization.INT8, Quantization.W8A8)

    @property
    def activation_group(self) -> int:
        """int8_matmul's `group`: 0, two digits per row (int8); GROUP, one digit per GROUP inputs (w8a8)."""
        return GROUP if self is Quantization.W8A8 else 0


AUTO = "auto"  # gguf for a GGUF file where its kernel runs well, else none (loader.resolve_quantization)
QUANTIZATIONS = (AUTO, *(q.value for q in Quantization))  # the flag's choices, as the user writes them


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
    """rows [N, in] as two digits each."""
    rows = rows.astype(jnp.float32)
    coarse, coarse_scale = quantize_rows(rows)
    fine, fine_scale = quantize_rows(rows - coarse * coarse_scale[:, None])
    return Int8Activations(jnp.concatenate([coarse, fine]), jnp.concatenate([coarse_scale, fine_scale]))


def tile(q: jax.Array) -> jax.Array:
    """int8 rows [out, in] -> the CPU kernel's tiles [ceil(out / 16), ceil(in / 32) * 8, 16, 4], zero
    padded: tiles[b, g, j, i] = q[16 b + j, 4 g + i]."""
    (out, depth), (tile_out, tile_in) = q.shape, TILE
    blocks, padded = -(-out // tile_out), -(-depth // GROUP) * GROUP
    q = jnp.pad(q, ((0, blocks * tile_out - out), (0, padded - depth)))
    return q.reshape(blocks, tile_out, padded // tile_in, tile_in).transpose(0, 2, 1, 3)


def rows_of(q: jax.Array, ids: jax.Array, depth: int) -> jax.Array:
    """Rows `ids` [N] of an int8 weight in rows or tiles -> [N, depth] (the embedding lookup)."""
    if not is_tiled(q):
        return jnp.take(q, ids, axis=0)
    tile_out = TILE[0]
    return q[ids // tile_out, :, ids % tile_out, :].reshape(ids.shape[0], -1)[:, :depth]


def is_tiled(q: jax.Array) -> bool:
    return q.ndim == 4


def tiles_weights(cpu_kernel: bool = True) -> bool:
    """Whether int8 weights loaded now go to the C++ kernel, in tiles: when `cpu_kernel` (the engine's
    cpu_int8_kernel setting), on a lone CPU device with AVX-512 VNNI. There the kernel runs every int8
    projection, quantizing x itself, 2-5x faster than XLA's ops from 1 to 512 tokens (docs/benchmarks.md).
    With several devices the weight may be sharded, and XLA cannot split a custom call."""
    return (
        cpu_kernel
        and jax.default_backend() == "cpu"
        and jax.device_count() == 1
        and cpu_kernels.int8_linear_available()
    )


def int8_matmul(
    x: jax.Array,
    q: jax.Array,
    scale: jax.Array,
    real_rows: jax.Array | None = None,
    norm: tuple[jax.Array, float] | None = None,
    group: int = 0,
) -> jax.Array:
    """norm(x) [..., in] times the int8 weight q (rows [out, in] or tiles) with its scale per output ->
    [..., out] in x's dtype; `group` picks the activations' scheme (Quantization.activation_group). Tiles go
    to the CPU kernel, which applies the RMSNorm `norm` = (weight, eps) itself; rows to XLA's ops.
    `real_rows` (int32 [1]): rows of x past it are padding; the CPU kernel skips them (their outputs are
    zeros), XLA's ops compute them anyway."""
    rows = x.reshape(-1, x.shape[-1])
    if is_tiled(q):
        y = cpu_kernels.int8_linear(rows.astype(jnp.float32), q, scale, real_rows, norm, group)
    else:
        rows = rows if norm is None else rms_norm(rows, *norm)
        if group:
            y = _xla_grouped_matmul(quantize_groups(rows, group), q, scale)
        else:
            y = _xla_int8_matmul(quantize_activations(rows), q, scale)
    return y.reshape(*x.shape[:-1], y.shape[-1]).astype(x.dtype)


def quantize_groups(rows: jax.Array, group: int) -> jax.Array:
    """rows [N, in] with each run of `group` inputs rounded to int8 digits d = round(x · 127 / m), m the
    run's max |x|, times their scale m / 127 (w8a8's activations, as floats: d · s is exact enough that a
    float matmul stands in for the int8 one). A product, not x / s: XLA turns that division into x · (1 / s)
    in some programs and not others, which moves digits that sit on a rounding tie."""
    n, depth = rows.shape
    padded = -(-depth // group) * group
    runs = jnp.pad(rows.astype(jnp.float32), ((0, 0), (0, padded - depth))).reshape(n, -1, group)
    top = jnp.max(jnp.abs(runs), axis=-1, keepdims=True)
    digits = jnp.round(runs * jnp.where(top == 0, 0.0, 127.0 / jnp.where(top == 0, 1.0, top)))
    return (digits * (top / 127.0)).reshape(n, padded)[:, :depth]


def _xla_grouped_matmul(rounded: jax.Array, q: jax.Array, scale: jax.Array) -> jax.Array:
    return jax.lax.dot_general(rounded, q.astype(jnp.float32), (((1,), (1,)), ((), ()))) * scale


def _xla_int8_matmul(x: Int8Activations, q: jax.Array, scale: jax.Array) -> jax.Array:
    acc = jax.lax.dot_general(x.digits, q, (((1,), (1,)), ((), ())), preferred_element_type=jnp.int32)
    acc = acc.astype(jnp.float32) * x.scales[:, None]
    n = acc.shape[0] // 2
    return (acc[:n] + acc[n:]) * scale
