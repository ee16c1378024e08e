"""Self-attention with GQA/MQA over the paged KV cache: project, (q/k norm), rotate, write K/V, attend."""

from __future__ import annotations

import jax
from flax import nnx

from jserve.attention import AttentionBackend, AttentionMetadata, KVPages
from jserve.config import ModelConfig
from jserve.models.linear import Linear
from jserve.models.low_rank import LayerAdapters
from jserve.models.norm import RMSNorm
from jserve.models.quantization import Quantization
from jserve.models.rotary import apply_rope


class Attention(nnx.Module):
    def __init__(self, config: ModelConfig, layer_idx: int, *, dtype, quantization: Quantization, shards: int = 1):
        hidden, dim = config.hidden_size, config.head_dim
        self.num_heads, self.num_kv_heads, self.head_dim = config.num_heads, config.num_kv_heads, dim
        self.sliding_window = config.sliding_windows[layer_idx]
        self.scale = (config.query_pre_attn_scalar or dim) ** -0.5
        self.soft_cap = config.attn_logit_softcapping
        q_out, kv_out, bias = self.num_heads * dim, self.num_kv_heads * dim, config.qkv_bias
        pieces = {"q_proj": q_out, "k_proj": kv_out, "v_proj": kv_out}
        self.qkv_proj = Linear(hidden, pieces, bias=bias, dtype=dtype, quantization=quantization, shards=shards)
        self.o_proj = Linear(q_out, hidden, bias=config.o_bias, dtype=dtype, quantization=quantization)
        # Qwen3 and Gemma 3 normalise each head's q and k before rotating them.
        self.q_norm = RMSNorm(dim, eps=config.rms_norm_eps, dtype=dtype) if config.qk_norm else None
        self.k_norm = RMSNorm(dim, eps=config.rms_norm_eps, dtype=dtype) if config.qk_norm else None

    def __call__(
        self,
        x: jax.Array,
        rope: tuple[jax.Array, jax.Array],
        kv: KVPages,
        meta: AttentionMetadata,
        attention: AttentionBackend,
        norm: RMSNorm | None = None,
        adapters: LayerAdapters | None = None,
    ) -> tuple[jax.Array, KVPages]:
        """Attention over norm(x), or x (the projection applies the norm: see Linear); `adapters`: the tokens'
        low-rank updates of the projections (low_rank.py)."""
        tokens = x.shape[0]
        qkv, o = (None, None) if adapters is None else (adapters.get("qkv_proj"), adapters.get("o_proj"))
        q, k, v = self.qkv_proj.split(self.qkv_proj(x, meta.real_tokens, norm, qkv))
        q = q.reshape(tokens, self.num_heads, self.head_dim)
        k = k.reshape(tokens, self.num_kv_heads, self.head_dim)
        v = v.reshape(tokens, self.num_kv_heads, self.head_dim)
        if self.q_norm is not None:
            q, k = self.q_norm(q), self.k_norm(k)
        q, k = apply_rope(q, *rope), apply_rope(k, *rope)
        out, kv = attention(q, k, v, kv, meta, scale=self.scale, sliding_window=self.sliding_window,
                            soft_cap=self.soft_cap)  # fmt: skip
        return self.o_proj(out.reshape(tokens, self.num_heads * self.head_dim), meta.real_tokens, delta=o), kv
