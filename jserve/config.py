"""The model's shape and numerics, as the loaders read them from a checkpoint (loader/hf_config.py, gguf_source.py)."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any

from jserve.errors import ModelLoadError

SUPPORTED_FAMILIES = ("llama", "mistral", "qwen2", "qwen3", "phi3", "gemma2", "gemma3", "mixtral", "qwen3_moe")
GEMMA_FAMILIES = ("gemma2", "gemma3")
SUPPORTED_ROPE_TYPES = ("default", "linear", "llama3", "longrope")


@dataclass(frozen=True)
class RopeScaling:
    rope_type: str  # one of SUPPORTED_ROPE_TYPES
    factor: float = 1.0
    low_freq_factor: float = 1.0
    high_freq_factor: float = 4.0
    original_max_position_embeddings: int = 8192
    # longrope (Phi-3): per-frequency divisors for contexts within the original length and beyond it, and
    # the factor cos and sin are scaled by; `long` says which divisors apply (see ModelConfig.for_context).
    short_factor: tuple[float, ...] | None = None
    long_factor: tuple[float, ...] | None = None
    attention_factor: float = 1.0
    long: bool = False


@dataclass(frozen=True)
class ModelConfig:
    family: str
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    rms_norm_eps: float
    rope_theta: float
    max_position_embeddings: int
    tie_word_embeddings: bool = False
    lm_head: bool = True  # False: the base model alone, its hidden states out (an embedder needs no head)
    qkv_bias: bool = False
    o_bias: bool = False
    mlp_bias: bool = False
    qk_norm: bool = False
    rope_scaling: RopeScaling | None = None
    # Per-frequency divisors some GGUF files carry instead of a rope_scaling block (llama.cpp's rope_freqs).
    rope_freq_factors: tuple[float, ...] | None = None
    # Per layer: attention window in tokens, or None for full attention.
    sliding_windows: tuple[int | None, ...] = ()
    rotary_dim: int = 0  # leading dims of each head that rotate (Phi's partial rotary); 0: all of head_dim
    # Gemma: GeGLU, embeddings scaled by sqrt(hidden), a norm before and after each sublayer, attention
    # scaled by query_pre_attn_scalar ** -0.5, sliding-window layers with a rope base of their own
    hidden_activation: str = "silu"  # or "gelu_tanh"
    embedding_multiplier: float = 1.0
    sandwich_norms: bool = False
    query_pre_attn_scalar: float | None = None  # None: head_dim
    local_rope_theta: float | None = None  # sliding-window layers' rope base (no scaling); None: rope_theta
    final_logit_softcapping: float | None = None  # logits = cap * tanh(logits / cap)
    attn_logit_softcapping: float | None = None  # attention scores likewise (Gemma 2)
    # Mixture of experts (Mixtral, Qwen3-MoE): in the layers marked in moe_layers the MLP is num_experts
    # experts of moe_intermediate_size; each token goes to the num_experts_per_tok with the highest router
    # probabilities, weighted by them (renormalized over those chosen if norm_topk_prob).
    num_experts: int = 0
    num_experts_per_tok: int = 0
    moe_intermediate_size: int = 0
    norm_topk_prob: bool = True
    moe_layers: tuple[bool, ...] = ()  # per layer, where only some have experts; () every layer (see has_experts)
    eos_token_ids: tuple[int, ...] = ()
    bos_token_id: int | None = None

    def __post_init__(self):
        if self.family not in SUPPORTED_FAMILIES:
            raise ModelLoadError(
                f"unsupported model family {self.family!r}; supported: {', '.join(SUPPORTED_FAMILIES)}"
            )
        if self.num_heads % self.num_kv_heads:
            raise ModelLoadError(
                f"num_heads ({self.num_heads}) must be a multiple of num_kv_heads ({self.num_kv_heads})"
            )
        if not self.sliding_windows:
            object.__setattr__(self, "sliding_windows", (None,) * self.num_layers)
        if not self.rotary_dim:
            object.__setattr__(self, "rotary_dim", self.head_dim)
        if self.rotary_dim % 2 or not 0 < self.rotary_dim <= self.head_dim:
            raise ModelLoadError(f"rotary_dim {self.rotary_dim} must be even and within head_dim {self.head_dim}")
        if len(self.sliding_windows) != self.num_layers:
            raise ModelLoadError(f"{len(self.sliding_windows)} sliding-window entries for {self.num_layers} layers")
        if self.moe_layers and len(self.moe_layers) != self.num_layers:
            raise ModelLoadError(f"{len(self.moe_layers)} mixture-of-experts entries for {self.num_layers} layers")
        if self.num_experts and not 0 < self.num_experts_per_tok <= self.num_experts:
            raise ModelLoadError(f"num_experts_per_tok {self.num_experts_per_tok} must be 1..{self.num_experts}")

    def has_experts(self, layer: int) -> bool:
        """Whether layer `layer`'s MLP is a mixture of experts."""
        return self.num_experts > 0 and (not self.moe_layers or self.moe_layers[layer])

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)

    def for_context(self, max_model_len: int | None) -> ModelConfig:
        """The config for serving contexts of up to `max_model_len` tokens (default: the model's length).
        longrope has one set of frequencies for contexts within the original training length and one beyond
        it; transformers switches between them by the length of each forward pass, which would rotate one
        sequence's keys two ways across steps, so (as llama.cpp does) the context the engine serves chooses."""
        scaling = self.rope_scaling
        if scaling is None or scaling.rope_type != "longrope":
            return self
        long = (max_model_len or self.max_position_embeddings) > scaling.original_max_position_embeddings
        return dataclasses.replace(self, rope_scaling=dataclasses.replace(scaling, long=long))

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> ModelConfig:
        data = dict(data)
        if data.get("rope_scaling") is not None:
            rope = dict(data["rope_scaling"])
            for key in ("short_factor", "long_factor"):
                if rope.get(key) is not None:
                    rope[key] = tuple(rope[key])
            data["rope_scaling"] = RopeScaling(**rope)
        for key in ("rope_freq_factors", "sliding_windows", "eos_token_ids", "moe_layers"):
            if data.get(key) is not None:
                data[key] = tuple(data[key])
        return cls(**data)


def sparse_layers(layers: list[bool]) -> tuple[bool, ...]:
    """ModelConfig.moe_layers for these layers with experts: () when every one has them."""
    return () if all(layers) else tuple(layers)
