"""A dense projection holding its weight in the checkpoint's [out, in] layout, so loading never transposes.
Quantized, the weight is int8 with a float32 scale per output feature, in rows or, where jserve's CPU
kernel runs it, in the kernel's tiles, and activations are quantized in the mode's scheme (quantization.py)."""

import jax
import jax.numpy as jnp
from flax import nnx

from jserve.models.norm import RMSNorm
from jserve.models.quantization import activation_group, int8_matmuls


class Linear(nnx.Module):
    def __init__(self, in_features: int, out_features: int, *, bias: bool, dtype, quantization: str = "none"):
        quantized = quantization != "none"
        self.activation_group = activation_group(quantization)
        self.weight = nnx.Param(jnp.zeros((out_features, in_features), jnp.int8 if quantized else dtype))
        self.weight_scale = nnx.Param(jnp.zeros((out_features,), jnp.float32)) if quantized else None
        self.bias = nnx.Param(jnp.zeros((out_features,), dtype)) if bias else None

    def __call__(self, x: jax.Array, real_rows: jax.Array | None = None) -> jax.Array:
        return project(x, self, real_rows=real_rows)[0]


def project(
    x: jax.Array, *linears: Linear, real_rows: jax.Array | None = None, norm: RMSNorm | None = None
) -> list[jax.Array]:
    """The projections of one input, norm(x) or x (q/k/v, gate/up). Quantized, they share its digits: one
    kernel call on a CPU, which applies the norm too, one quantization elsewhere. `real_rows` (int32 [1]):
    x's rows past it are a step's padding, which the CPU kernel skips."""
    if linears[0].weight_scale is None:
        x = x if norm is None else norm(x)
        ys = [jax.lax.dot_general(x, p.weight[...], (((x.ndim - 1,), (1,)), ((), ()))) for p in linears]
    else:
        weights = [(p.weight[...], p.weight_scale[...]) for p in linears]
        norm = None if norm is None else norm.params
        ys = int8_matmuls(x, weights, real_rows, norm, linears[0].activation_group)
    return [y if p.bias is None else y + p.bias[...] for p, y in zip(linears, ys, strict=True)]
