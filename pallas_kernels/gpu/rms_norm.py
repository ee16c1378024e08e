"""RMSNorm of a single row for NVIDIA GPUs: a Pallas kernel lowered through Triton.

XLA:GPU makes a norm over two or more rows one Triton kernel of its own, but splits a single row's (a lone
decode's hidden state) in two: the sum of squares, then the scaling, a kernel each, for every norm of every
layer. This is one kernel doing what `jserve.models.norm.rms_norm` does: float32, cast back, times the weight.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plt


def rms_norm_row(x: jax.Array, weight: jax.Array, eps: float, *, interpret: bool = False) -> jax.Array:
    """x [..., H] holding one row (x.size == H), normalised and scaled by weight [H]."""
    hidden = x.shape[-1]
    if x.size != hidden:
        raise ValueError(f"rms_norm_row takes a single row, got {x.shape}")
    # Triton's blocks are powers of two: the row is read in chunks of the largest one dividing it
    # (4096 -> 1 chunk, 3584 -> 7 of 512, 576 -> 9 of 64).
    chunk = hidden & -hidden
    kernel = functools.partial(_kernel, eps=eps, chunk=chunk, num_chunks=hidden // chunk)
    out = pl.pallas_call(
        kernel,
        out_shape=jax.ShapeDtypeStruct((hidden,), jnp.result_type(weight.dtype, x.dtype)),
        interpret=interpret,
        compiler_params=plt.CompilerParams(num_warps=4),
        name="rms_norm_row",
    )(x.reshape(hidden), weight)
    return out.reshape(x.shape)


def _kernel(x_ref, w_ref, out_ref, *, eps: float, chunk: int, num_chunks: int):
    def squares(i, total):
        part = x_ref[pl.ds(i * chunk, chunk)].astype(jnp.float32)
        return total + jnp.sum(part * part)

    total = jax.lax.fori_loop(0, num_chunks, squares, jnp.zeros((), jnp.float32))
    scale = jax.lax.rsqrt(total / (chunk * num_chunks) + eps)

    def write(i, carry):
        at = pl.ds(i * chunk, chunk)
        normed = (x_ref[at].astype(jnp.float32) * scale).astype(x_ref.dtype)
        out_ref[at] = (w_ref[at] * normed).astype(out_ref.dtype)
        return carry

    jax.lax.fori_loop(0, num_chunks, write, 0)
