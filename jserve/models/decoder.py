"""One pre-norm decoder layer: x + attn(norm(x)), then + mlp(norm(x)) (a dense MLP or a mixture of experts)."""

from __future__ import annotations

import jax
from flax import nnx

from jserve.attention import AttentionBackend, AttentionMetadata, KVPages
from jserve.config import ModelConfig
from jserve.models.attention import Attention
from jserve.models.low_rank import LayerAdapters
from jserve.models.mlp import MLP
from jserve.models.moe import SparseMoE
from jserve.models.norm import RMSNorm
from jserve.models.quantization import Quantization
from jserve.parallel import Parallelism


class DecoderLayer(nnx.Module):
    def __init__(
        self, config: ModelConfig, layer_idx: int, *, dtype, quantization: Quantization, parallelism: Parallelism
    ):
        shards = parallelism.shards
        self.input_layernorm = RMSNorm(config.hidden_size, eps=config.rms_norm_eps, dtype=dtype)
        self.self_attn = Attention(config, layer_idx, dtype=dtype, quantization=quantization, shards=shards)
        self.post_attention_layernorm = RMSNorm(config.hidden_size, eps=config.rms_norm_eps, dtype=dtype)
        if config.has_experts(layer_idx):
            self.mlp = SparseMoE(config, dtype=dtype, quantization=quantization, parallelism=parallelism)
        else:
            self.mlp = MLP(config, dtype=dtype, quantization=quantization, shards=shards)

    def __call__(
        self,
        x: jax.Array,
        rope: tuple[jax.Array, jax.Array],
        kv: KVPages,
        meta: AttentionMetadata,
        attention: AttentionBackend,
        adapters: LayerAdapters | None = None,
    ) -> tuple[jax.Array, KVPages]:
        # The norms go with x into the projections, which apply them (on a CPU, inside the int8 kernel).
        attn_out, kv = self.self_attn(x, rope, kv, meta, attention, self.input_layernorm, adapters)
        x = x + attn_out
        return x + self.mlp(x, meta.real_tokens, self.post_attention_layernorm, adapters), kv
