"""Gemma's decoder layer: each sublayer between two norms, x + norm(attn(norm(x))), then
+ norm(mlp(norm(x))). The Llama layer's modules, with post_attention_layernorm after attention (not before the
MLP) and two more norms around the MLP: pre_feedforward_layernorm and post_feedforward_layernorm."""

from __future__ import annotations

import jax

from jserve.attention import AttentionBackend, AttentionMetadata, KVPages
from jserve.config import ModelConfig
from jserve.models.decoder import DecoderLayer
from jserve.models.low_rank import LayerAdapters
from jserve.models.norm import RMSNorm
from jserve.models.quantization import Quantization
from jserve.parallel import Parallelism


class SandwichDecoderLayer(DecoderLayer):
    def __init__(
        self, config: ModelConfig, layer_idx: int, *, dtype, quantization: Quantization, parallelism: Parallelism
    ):
        super().__init__(config, layer_idx, dtype=dtype, quantization=quantization, parallelism=parallelism)
        self.pre_feedforward_layernorm = RMSNorm(config.hidden_size, eps=config.rms_norm_eps, dtype=dtype)
        self.post_feedforward_layernorm = RMSNorm(config.hidden_size, eps=config.rms_norm_eps, dtype=dtype)

    def __call__(
        self, x: jax.Array, rope: tuple[jax.Array, jax.Array], kv: KVPages, meta: AttentionMetadata,
        attention: AttentionBackend, adapters: LayerAdapters | None = None,
    ) -> tuple[jax.Array, KVPages]:  # fmt: skip
        attn_out, kv = self.self_attn(x, rope, kv, meta, attention, self.input_layernorm, adapters)
        x = x + self.post_attention_layernorm(attn_out)
        mlp_out = self.mlp(x, meta.real_tokens, self.pre_feedforward_layernorm, adapters)
        return x + self.post_feedforward_layernorm(mlp_out), kv
