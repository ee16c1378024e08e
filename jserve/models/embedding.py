"""Token embedding; its table doubles as the LM head when the checkpoint ties them."""

import jax
import jax.numpy as jnp
from flax import nnx


class Embedding(nnx.Module):
    def __init__(self, vocab_size: int, hidden_size: int, *, dtype):
        self.weight = nnx.Param(jnp.zeros((vocab_size, hidden_size), dtype))

    def __call__(self, token_ids: jax.Array) -> jax.Array:
        return jnp.take(self.weight[...], token_ids, axis=0)

    def attend(self, hidden: jax.Array) -> jax.Array:
        """Logits against the embedding table (a tied LM head)."""
        return jax.lax.dot_general(hidden, self.weight[...], (((hidden.ndim - 1,), (1,)), ((), ())))
