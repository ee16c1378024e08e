"""Token embedding; its table doubles as the LM head when the checkpoint ties them. Quantized, the table
is int8 with a float32 scale per token row."""

import jax
import jax.numpy as jnp
from flax import nnx

from jserve.models.quantization import int8_matmul


class Embedding(nnx.Module):
    def __init__(self, vocab_size: int, hidden_size: int, *, dtype, quantized: bool = False):
        self.dtype = dtype
        self.weight = nnx.Param(jnp.zeros((vocab_size, hidden_size), jnp.int8 if quantized else dtype))
        self.weight_scale = nnx.Param(jnp.zeros((vocab_size,), jnp.float32)) if quantized else None

    def __call__(self, token_ids: jax.Array) -> jax.Array:
        rows = jnp.take(self.weight[...], token_ids, axis=0)
        if self.weight_scale is None:
            return rows
        return (rows * jnp.take(self.weight_scale[...], token_ids)[:, None]).astype(self.dtype)

    def attend(self, hidden: jax.Array) -> jax.Array:
        """Logits against the embedding table (a tied LM head)."""
        if self.weight_scale is not None:
            return int8_matmul(hidden, self.weight[...], self.weight_scale[...])
        return jax.lax.dot_general(hidden, self.weight[...], (((hidden.ndim - 1,), (1,)), ((), ())))
