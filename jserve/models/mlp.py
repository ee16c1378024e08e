"""SwiGLU feed-forward: down(silu(gate(x)) * up(x))."""

import jax
from flax import nnx

from jserve.config import ModelConfig
from jserve.models.linear import Linear


class MLP(nnx.Module):
    def __init__(self, config: ModelConfig, *, dtype):
        hidden, inner, bias = config.hidden_size, config.intermediate_size, config.mlp_bias
        self.gate_proj = Linear(hidden, inner, bias=bias, dtype=dtype)
        self.up_proj = Linear(hidden, inner, bias=bias, dtype=dtype)
        self.down_proj = Linear(inner, hidden, bias=bias, dtype=dtype)

    def __call__(self, x: jax.Array) -> jax.Array:
        return self.down_proj(jax.nn.silu(self.gate_proj(x)) * self.up_proj(x))
