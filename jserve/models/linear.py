"""A dense projection holding its weight in the checkpoint's [out, in] layout, so loading never transposes.
Quantized, the weight is int8 with a float32 scale per output feature (see quantization.py)."""

import jax
import jax.numpy as jnp
from flax import nnx

from jserve.models.quantization import Int8Activations, int8_matmul, prepare_activations


class Linear(nnx.Module):
    def __init__(self, in_features: int, out_features: int, *, bias: bool, dtype, quantized: bool = False):
        self.weight = nnx.Param(jnp.zeros((out_features, in_features), jnp.int8 if quantized else dtype))
        self.weight_scale = nnx.Param(jnp.zeros((out_features,), jnp.float32)) if quantized else None
        self.bias = nnx.Param(jnp.zeros((out_features,), dtype)) if bias else None

    def prepare(self, x: jax.Array) -> jax.Array | Int8Activations:
        """x as this projection multiplies it; projections of one input (q/k/v, gate/up) share it."""
        return x if self.weight_scale is None else prepare_activations(x)

    def __call__(self, x: jax.Array | Int8Activations) -> jax.Array:
        if self.weight_scale is None:
            y = jax.lax.dot_general(x, self.weight[...], (((x.ndim - 1,), (1,)), ((), ())))
        else:
            y = int8_matmul(x, self.weight[...], self.weight_scale[...])
        return y if self.bias is None else y + self.bias[...]
