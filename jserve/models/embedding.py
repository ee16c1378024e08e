"""Token embedding; its table doubles as the LM head when the checkpoint ties them. Quantized, the table
is int8 with a float32 scale per token row (in rows, or in the CPU kernel's tiles: see quantization.py); kept
from a GGUF file, the file's blocks in the format `ggml_type` (loader/gguf_blocks.py)."""

import jax
import jax.numpy as jnp
from flax import nnx

from jserve import cpu_kernels
from jserve.models.norm import RMSNorm
from jserve.models.quantization import Quantization, int8_matmul, rows_of


class Embedding(nnx.Module):
    def __init__(self, vocab_size: int, hidden_size: int, *, dtype, quantization: Quantization):
        quantized = quantization.quantized
        self.dtype, self.hidden_size, self.activation_group = dtype, hidden_size, quantization.activation_group
        self.weight = nnx.Param(jnp.zeros((vocab_size, hidden_size), jnp.int8 if quantized else dtype))
        self.weight_scale = nnx.Param(jnp.zeros((vocab_size,), jnp.float32)) if quantized else None
        self.vocab_size, self.ggml_type = vocab_size, None

    def __call__(self, token_ids: jax.Array) -> jax.Array:
        if self.ggml_type is not None:
            rows = cpu_kernels.gguf_rows(self.weight[...], self.ggml_type, self.hidden_size, token_ids)
            return rows.astype(self.dtype)
        if self.weight_scale is None:
            return jnp.take(self.weight[...], token_ids, axis=0)
        rows = rows_of(self.weight[...], token_ids, self.hidden_size)
        return (rows * jnp.take(self.weight_scale[...], token_ids)[:, None]).astype(self.dtype)

    def attend(self, hidden: jax.Array, norm: RMSNorm) -> jax.Array:
        """Logits of norm(hidden) against the embedding table (a tied LM head)."""
        if self.ggml_type is not None:
            logits = cpu_kernels.gguf_linear(
                hidden, self.weight[...], ((self.ggml_type, self.vocab_size),), norm=norm.params
            )
            return logits.astype(hidden.dtype)
        if self.weight_scale is not None:
            weight, scale = self.weight[...], self.weight_scale[...]
            return int8_matmul(hidden, weight, scale, norm=norm.params, group=self.activation_group)
        hidden = norm(hidden)
        return jax.lax.dot_general(hidden, self.weight[...], (((hidden.ndim - 1,), (1,)), ((), ())))
