"""Gemma's decoder layer: each sublayer between two norms, x + norm(attn(norm(x))), then
+ norm(mlp(norm(x))). Checkpoint names: input_layernorm and post_attention_layernorm around attention,
pre_feedforward_layernorm and post_feedforward_layernorm around the MLP."""

from __future__ import annotations

import jax
from flax import nnx

from jserve.attention import AttentionBackend, AttentionMetadata, KVPages
from jserve.config import ModelConfig
from jserve.models.attention import Attention
from jserve.models.mlp import MLP
from jserve.models.norm import RMSNorm
from jserve.models.quantization import Quantization


class SandwichDecoderLayer(nnx.Module):
    def __init__(self, config: ModelConfig, layer_idx: int, *, dtype, quantization: Quantization, shards: int = 1):
        size, eps = config.hidden_size, config.rms_norm_eps
        self.input_layernorm = RMSNorm(size, eps=eps, dtype=dtype)
        self.self_attn = Attention(config, layer_idx, dtype=dtype, quantization=quantization, shards=shards)
        self.post_attention_layernorm = RMSNorm(size, eps=eps, dtype=dtype)
        self.pre_feedforward_layernorm = RMSNorm(size, eps=eps, dtype=dtype)
        self.mlp = MLP(config, dtype=dtype, quantization=quantization, shards=shards)
        self.post_feedforward_layernorm = RMSNorm(size, eps=eps, dtype=dtype)

    def __call__(
        self,
        x: jax.Array,
        rope: tuple[jax.Array, jax.Array],
        kv: KVPages,
        meta: AttentionMetadata,
        attention: AttentionBackend,
    ) -> tuple[jax.Array, KVPages]:
        attn_out, kv = self.self_attn(x, rope, kv, meta, attention, norm=self.input_layernorm)
        x = x + self.post_attention_layernorm(attn_out)
        mlp_out = self.mlp(x, meta.real_tokens, norm=self.pre_feedforward_layernorm)
        return x + self.post_feedforward_layernorm(mlp_out), kv
