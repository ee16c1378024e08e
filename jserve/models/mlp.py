"""SwiGLU feed-forward: down(silu(gate(x)) * up(x))."""

import jax
from flax import nnx

from jserve.config import ModelConfig
from jserve.models.linear import Linear, project
from jserve.models.norm import RMSNorm


class MLP(nnx.Module):
    def __init__(self, config: ModelConfig, *, dtype, quantization: str = "none"):
        hidden, inner, bias = config.hidden_size, config.intermediate_size, config.mlp_bias
        self.gate_proj = Linear(hidden, inner, bias=bias, dtype=dtype, quantization=quantization)
        self.up_proj = Linear(hidden, inner, bias=bias, dtype=dtype, quantization=quantization)
        self.down_proj = Linear(inner, hidden, bias=bias, dtype=dtype, quantization=quantization)

    def __call__(self, x: jax.Array, real_rows: jax.Array | None = None, norm: RMSNorm | None = None) -> jax.Array:
        """mlp(norm(x)), or mlp(x); `real_rows` (int32 [1]): x's rows past it are padding (see linear.project)."""
        gate, up = project(x, self.gate_proj, self.up_proj, real_rows=real_rows, norm=norm)
        return self.down_proj(jax.nn.silu(gate) * up, real_rows)
