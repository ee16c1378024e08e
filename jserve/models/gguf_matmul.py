"""Projections whose weights are a GGUF file's blocks (`--quantization gguf`), by step size.

Up to KERNEL_TOKENS tokens the C++ kernel multiplies straight from the blocks, reading a quarter to an
eighth of float32's bytes. Beyond, the step is bound by arithmetic rather than memory, and XLA's float
matmul beats the kernel's buffered rows: the weight is dequantized for the step (its exact float values)
and XLA multiplies it. The threshold is measured on SmolLM2 (benchmarks/roofline.py --quantization gguf):
a 64-token decode step took 299 ms in the kernel and 380 ms dequantized, a 512-token prefill step 1655 ms
and 961 ms. The token count is the step's
bucket, static, so each compiled step holds one of the two.
"""

from __future__ import annotations

import jax

from jserve import cpu_kernels
from jserve.models.norm import rms_norm

KERNEL_TOKENS = 128


def gguf_matmul(
    x: jax.Array,
    w: jax.Array,
    segments: tuple[tuple[int, int], ...],
    real_rows: jax.Array | None = None,
    norm: tuple[jax.Array, float] | None = None,
) -> jax.Array:
    """norm(x) [T, in] times the block weight `w` (flat uint8, `segments` as cpu_kernels.gguf_linear) ->
    [T, out] in x's dtype."""
    if x.shape[0] <= KERNEL_TOKENS:
        return cpu_kernels.gguf_linear(x, w, segments, real_rows, norm).astype(x.dtype)
    dense = cpu_kernels.gguf_dequantize(w, segments, x.shape[-1])
    x = x if norm is None else rms_norm(x, *norm)
    return jax.lax.dot_general(x, dense.astype(x.dtype), (((x.ndim - 1,), (1,)), ((), ())))
