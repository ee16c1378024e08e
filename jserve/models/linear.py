"""A dense projection holding its weight in the checkpoint's [out, in] layout, so loading never transposes."""

import jax
import jax.numpy as jnp
from flax import nnx


class Linear(nnx.Module):
    def __init__(self, in_features: int, out_features: int, *, bias: bool, dtype):
        self.weight = nnx.Param(jnp.zeros((out_features, in_features), dtype))
        self.bias = nnx.Param(jnp.zeros((out_features,), dtype)) if bias else None

    def __call__(self, x: jax.Array) -> jax.Array:
        y = jax.lax.dot_general(x, self.weight[...], (((x.ndim - 1,), (1,)), ((), ())))
        return y if self.bias is None else y + self.bias[...]
