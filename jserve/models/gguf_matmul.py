"""Projections whose weights are a GGUF file's blocks (`--quantization gguf`), by format and step size.

The C++ kernel multiplies straight from the blocks, reading a quarter to an eighth of float32's bytes.
Q4_0, Q4_1, Q8_0, Q4_K and Q6_K weights (tiled, integer products: cpu_kernels/gguf_tiles.h) always take
it: at 512 tokens it beat XLA's float32 matmul too (benchmarks/gguf_kernel.py). The other formats' (Q5_0,
Q5_1, Q5_K) float kernel loses
to XLA once a step is bound by arithmetic, so past KERNEL_TOKENS tokens their weight is dequantized for
the step (its exact float values) and XLA multiplies it: measured on SmolLM2, a 512-token prefill step took
1655 ms in that kernel and 961 ms dequantized. The token count is the step's bucket, static, so each
compiled step holds one of the two.
"""

from __future__ import annotations

import jax

from jserve import cpu_kernels
from jserve.cpu_kernels.gguf_tiles import tiled
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
    if x.shape[0] <= KERNEL_TOKENS or all(tiled(ggml_type) for ggml_type, _ in segments):
        return cpu_kernels.gguf_linear(x, w, segments, real_rows, norm).astype(x.dtype)
    dense = cpu_kernels.gguf_dequantize(w, segments, x.shape[-1])
    x = x if norm is None else rms_norm(x, *norm)
    return jax.lax.dot_general(x, dense.astype(x.dtype), (((x.ndim - 1,), (1,)), ((), ())))
