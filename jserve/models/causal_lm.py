"""The decoder-only causal LM shared by every family (Llama, Mistral, Qwen2/3, Phi-3, Gemma 2/3, Mixtral, Qwen3-MoE).

Parameter paths mirror Hugging Face names without the `model.` prefix (`layers.3.self_attn.o_proj.weight`),
so checkpoints map onto the module tree by name; a fused projection (`self_attn.qkv_proj`, `mlp.gate_up_proj`)
names the checkpoint tensors it holds (fused.py).
"""

from __future__ import annotations

from functools import partial

import jax
import jax.numpy as jnp
from flax import nnx

from jserve.attention import REFERENCE, AttentionBackend, KVCache, ModelInput
from jserve.config import ModelConfig
from jserve.models.decoder import DecoderLayer
from jserve.models.embedding import Embedding
from jserve.models.linear import Linear
from jserve.models.low_rank import Adapters
from jserve.models.norm import RMSNorm
from jserve.models.quantization import Quantization
from jserve.models.rotary import attention_factor, inverse_frequencies, rope_angles, sliding_layers_rope
from jserve.models.sandwich_decoder import SandwichDecoderLayer
from jserve.parallel import Parallelism


class CausalLM(nnx.Module):
    def __init__(
        self,
        config: ModelConfig,
        *,
        dtype=jnp.float32,
        quantization: str = "none",
        parallelism: Parallelism | None = None,
    ):
        """`quantization` int8 or w8a8: every projection, the embedding and the head hold int8 weights (norms
        and routers stay float), and multiply activations in that scheme (quantization.py). `parallelism`:
        the tensor-parallel devices, whose blocks of rows the fused projections order theirs for (fused.py),
        and how a mixture of experts splits over them (moe.py)."""
        self.config = config
        parallelism = parallelism or Parallelism()
        quantization = Quantization(quantization)  # a name ("int8") or the mode itself
        self.embed_tokens = Embedding(config.vocab_size, config.hidden_size, dtype=dtype, quantization=quantization)
        # A Python list, unrolled at trace time: measured ~2x faster than lax.scan over stacked layers on CPU.
        layer = SandwichDecoderLayer if config.sandwich_norms else DecoderLayer
        self.layers = nnx.List(
            [
                layer(config, i, dtype=dtype, quantization=quantization, parallelism=parallelism)
                for i in range(config.num_layers)
            ]
        )
        self.norm = RMSNorm(config.hidden_size, eps=config.rms_norm_eps, dtype=dtype)
        tied, head = config.tie_word_embeddings, (config.hidden_size, config.vocab_size)
        untied_head = config.lm_head and not tied
        self.lm_head = Linear(*head, bias=False, dtype=dtype, quantization=quantization) if untied_head else None

    def __call__(
        self, batch: ModelInput, kv_cache: KVCache, attention: AttentionBackend = REFERENCE
    ) -> tuple[jax.Array, KVCache]:
        """Run the batch's tokens, write their K/V; returns float32 logits [L, vocab] at batch.logits_indices."""
        hidden, kv_cache = self.hidden_states(batch, kv_cache, attention)
        return self.logits(hidden[batch.logits_indices]), kv_cache

    def hidden_states(
        self,
        batch: ModelInput,
        kv_cache: KVCache,
        attention: AttentionBackend = REFERENCE,
        adapters: Adapters | None = None,
    ) -> tuple[jax.Array, KVCache]:
        """Run the batch's tokens, write their K/V; returns the last layer's output [T, hidden] (before the final
        norm, which the head applies). `adapters`: each token's LoRA adapter and their weights (low_rank.py)."""
        meta, config = batch.attention, self.config
        # (the frequencies and the factor are trace-time constants)
        rope = rope_angles(meta.positions, inverse_frequencies(config), attention_factor(config))
        local_rope = rope
        if (local := sliding_layers_rope(config)) is not config:  # Gemma 3: a base of their own
            local_rope = rope_angles(meta.positions, inverse_frequencies(local), attention_factor(local))
        x = self.embed_tokens(batch.token_ids)
        if config.embedding_multiplier != 1.0:
            x = x * jnp.asarray(config.embedding_multiplier, x.dtype)
        for i, (layer, window) in enumerate(zip(self.layers, config.sliding_windows, strict=True)):
            layer_rope = rope if window is None else local_rope
            layer_meta = meta.for_layer(kv_cache.first_page(i), kv_cache.page_size)
            layer_adapters = None if adapters is None else adapters.layer(i)
            x, kv_cache = _run_layer(*nnx.split(layer), x, layer_rope, kv_cache, layer_meta, attention, layer_adapters)
        return x, kv_cache

    def logits(self, hidden: jax.Array) -> jax.Array:
        """float32 next-token logits [N, vocab] of hidden states [N, hidden]: the final norm and the head."""
        if not self.config.lm_head:
            raise ValueError("this model was loaded without its head (as an embedder): it has no logits")
        if self.lm_head is None:
            logits = self.embed_tokens.attend(hidden, self.norm)
        else:
            logits = self.lm_head(hidden, norm=self.norm)
        logits = logits.astype(jnp.float32)
        if (cap := self.config.final_logit_softcapping) is not None:
            logits = cap * jnp.tanh(logits / cap)
        return logits


# Jitted so that a step traces and lowers one decoder layer and calls it from every layer (their structure
# and shapes are the same): tracing 30 unrolled layers was most of each bucket's start-up. XLA inlines the
# calls again (steps measured as fast or faster: docs/benchmarks.md).
@partial(jax.jit, static_argnums=(0, 6))
def _run_layer(graphdef, state, x, rope, kv, meta, attention, adapters):
    return nnx.merge(graphdef, state)(x, rope, kv, meta, attention, adapters)
