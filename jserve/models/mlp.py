"""Gated feed-forward: down(act(gate(x)) * up(x)), act SiLU (SwiGLU) or tanh-approximated GELU (GeGLU)."""

import jax
from flax import nnx

from jserve.config import ModelConfig
from jserve.models.linear import Linear
from jserve.models.low_rank import LayerAdapters
from jserve.models.norm import RMSNorm
from jserve.models.quantization import Quantization


class MLP(nnx.Module):
    def __init__(self, config: ModelConfig, *, dtype, quantization: Quantization, shards: int = 1):
        hidden, inner, bias = config.hidden_size, config.intermediate_size, config.mlp_bias
        pieces = {"gate_proj": inner, "up_proj": inner}
        self.gate_up_proj = Linear(hidden, pieces, bias=bias, dtype=dtype, quantization=quantization, shards=shards)
        self.down_proj = Linear(inner, hidden, bias=bias, dtype=dtype, quantization=quantization)
        self.gelu = config.hidden_activation == "gelu_tanh"

    def __call__(
        self,
        x: jax.Array,
        real_rows: jax.Array | None = None,
        norm: RMSNorm | None = None,
        adapters: LayerAdapters | None = None,
    ) -> jax.Array:
        """mlp(norm(x)), or mlp(x); `real_rows` (int32 [1]): x's rows past it are padding (see Linear.__call__);
        `adapters`: the tokens' low-rank updates of the projections (low_rank.py)."""
        gate_up, down = (None, None) if adapters is None else (adapters.get("gate_up_proj"), adapters.get("down_proj"))
        gate, up = self.gate_up_proj.split(self.gate_up_proj(x, real_rows, norm, gate_up))
        return self.down_proj(gated(gate, up, self.gelu), real_rows, delta=down)


def gated(gate: jax.Array, up: jax.Array, gelu: bool) -> jax.Array:
    """act(gate) * up: SiLU, or tanh-approximated GELU (Gemma), the act of every gated MLP (dense or expert)."""
    return (jax.nn.gelu(gate, approximate=True) if gelu else jax.nn.silu(gate)) * up
