"""The model's shape and numerics, read from a Hugging Face config.json or GGUF metadata."""

from __future__ import annotations

import dataclasses
import json
import math
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from jserve.errors import ModelLoadError

# Hugging Face class name / model_type -> jserve family.
HF_ARCHITECTURES = {
    "LlamaForCausalLM": "llama",
    "MistralForCausalLM": "mistral",
    "Qwen2ForCausalLM": "qwen2",
    "Qwen3ForCausalLM": "qwen3",
    "Phi3ForCausalLM": "phi3",
    "Gemma2ForCausalLM": "gemma2",
    "Gemma3ForCausalLM": "gemma3",
    "MixtralForCausalLM": "mixtral",
    "Qwen3MoeForCausalLM": "qwen3_moe",
}
MODEL_TYPES = {"gemma3_text": "gemma3"}  # config.json model_type -> family, where they differ
SUPPORTED_FAMILIES = ("llama", "mistral", "qwen2", "qwen3", "phi3", "gemma2", "gemma3", "mixtral", "qwen3_moe")
GEMMA_FAMILIES = ("gemma2", "gemma3")
SUPPORTED_ROPE_TYPES = ("default", "linear", "llama3", "longrope")
ROPE_TYPE_ALIASES = {"su": "longrope"}  # Phi-3's first configs


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


def family_from_hf(config: dict[str, Any], source: str) -> str:
    for name in config.get("architectures") or ():
        if name in HF_ARCHITECTURES:
            return HF_ARCHITECTURES[name]
    model_type = MODEL_TYPES.get(config.get("model_type"), config.get("model_type"))
    if model_type in SUPPORTED_FAMILIES:
        return model_type
    found = config.get("architectures") or model_type
    raise ModelLoadError(
        f"{source}: unsupported architecture {found!r}; supported: {', '.join(sorted(HF_ARCHITECTURES))} "
        f"(model_type {', '.join(SUPPORTED_FAMILIES)})"
    )


def rope_from_hf(config: dict[str, Any], source: str) -> tuple[float, RopeScaling | None]:
    """(rope_theta, scaling) from either transformers 5's `rope_parameters` or the older `rope_scaling`."""
    params = dict(config.get("rope_parameters") or config.get("rope_scaling") or {})
    params = params.get("full_attention", params)  # per layer type (Gemma 3): the global layers'
    theta = float(params.get("rope_theta", config.get("rope_theta", 10000.0)))
    rope_type = params.get("rope_type", params.get("type", "default"))
    rope_type = ROPE_TYPE_ALIASES.get(rope_type, rope_type)
    if rope_type == "longrope":
        return theta, longrope_from_hf(config, params)
    if rope_type not in SUPPORTED_ROPE_TYPES:
        raise ModelLoadError(
            f"{source}: unsupported rope type {rope_type!r}; supported: {', '.join(SUPPORTED_ROPE_TYPES)}"
        )
    if rope_type == "default":
        return theta, None
    fields = {f.name for f in dataclasses.fields(RopeScaling)}
    return theta, RopeScaling(
        rope_type=rope_type, **{k: v for k, v in params.items() if k in fields and k != "rope_type"}
    )


def longrope_from_hf(config: dict[str, Any], params: dict[str, Any]) -> RopeScaling:
    """Phi-3's longrope: its factors, and the cos/sin scale transformers derives when none is given (from the
    ratio of the extended context to the original one)."""
    original = params.get("original_max_position_embeddings") or config.get("original_max_position_embeddings")
    max_positions = config.get("max_position_embeddings", 2048)
    original = original or max_positions
    factor = params.get("factor") or max_positions / original
    attention_factor = params.get("attention_factor")
    if attention_factor is None:
        attention_factor = 1.0 if factor <= 1 else math.sqrt(1 + math.log(factor) / math.log(original))
    return RopeScaling(
        "longrope",
        factor=float(factor),
        original_max_position_embeddings=int(original),
        short_factor=tuple(float(x) for x in params["short_factor"]),
        long_factor=tuple(float(x) for x in params["long_factor"]),
        attention_factor=float(attention_factor),
    )


def gemma_fields(config: dict[str, Any], family: str, hidden: int) -> dict[str, Any]:
    """ModelConfig fields of the Gemma layout (none for other families); refuses what jserve lacks."""
    if family not in GEMMA_FAMILIES:
        return {}
    if config.get("use_bidirectional_attention"):
        raise ModelLoadError("bidirectional attention (use_bidirectional_attention) is not supported")
    activation = config.get("hidden_activation") or config.get("hidden_act") or "gelu_pytorch_tanh"
    if activation not in ("gelu_pytorch_tanh", "gelu_tanh"):
        raise ModelLoadError(f"unsupported hidden_activation {activation!r} for {family}; supported: gelu_pytorch_tanh")
    params = config.get("rope_parameters") or {}
    local = (params.get("sliding_attention") or {}).get("rope_theta", config.get("rope_local_base_freq", 10000.0))
    return dict(
        hidden_activation="gelu_tanh",
        embedding_multiplier=hidden**0.5,
        sandwich_norms=True,
        query_pre_attn_scalar=float(config.get("query_pre_attn_scalar", 256)),
        local_rope_theta=float(local) if family == "gemma3" else None,  # Gemma 2: one rope for all layers
        final_logit_softcapping=config.get("final_logit_softcapping"),
        attn_logit_softcapping=config.get("attn_logit_softcapping"),
        qk_norm=family == "gemma3",
    )


def moe_fields(config: dict[str, Any], family: str, num_layers: int) -> dict[str, Any]:
    """ModelConfig fields of a mixture of experts (none for dense families)."""
    if family not in ("mixtral", "qwen3_moe"):
        return {}
    # Hub configs name the count num_local_experts (Mixtral) or num_experts (Qwen3-MoE); transformers 5 writes
    # num_local_experts for both.
    experts = config.get("num_local_experts", config.get("num_experts"))
    if experts is None:
        raise KeyError("num_local_experts")
    fields = dict(num_experts=experts, num_experts_per_tok=config["num_experts_per_tok"])
    if family == "mixtral":  # every layer, experts as wide as the intermediate size, top-k renormalized
        return fields | dict(moe_intermediate_size=config["intermediate_size"])
    # Qwen3-MoE: every decoder_sparse_step-th layer not listed in mlp_only_layers
    step, dense = config.get("decoder_sparse_step", 1), set(config.get("mlp_only_layers") or ())
    return fields | dict(
        moe_intermediate_size=config["moe_intermediate_size"],
        norm_topk_prob=bool(config.get("norm_topk_prob", False)),
        moe_layers=sparse_layers([i not in dense and (i + 1) % step == 0 for i in range(num_layers)]),
    )


def sparse_layers(layers: list[bool]) -> tuple[bool, ...]:
    """ModelConfig.moe_layers for these layers with experts: () when every one has them."""
    return () if all(layers) else tuple(layers)


def rotary_dim_from_hf(config: dict[str, Any], head_dim: int) -> int:
    params = config.get("rope_parameters") or config.get("rope_scaling") or {}
    factor = params.get("partial_rotary_factor", config.get("partial_rotary_factor", 1.0))
    return int(head_dim * factor)


def sliding_windows_from_hf(config: dict[str, Any], family: str, num_layers: int) -> tuple[int | None, ...]:
    window = config.get("sliding_window")
    if window is None:
        return (None,) * num_layers
    layer_types = config.get("layer_types")
    if layer_types is not None:
        return tuple(window if kind == "sliding_attention" else None for kind in layer_types)
    if family in ("qwen2", "qwen3", "qwen3_moe"):
        # Older Qwen configs: sliding only when enabled, and only from max_window_layers on.
        if not config.get("use_sliding_window", False):
            return (None,) * num_layers
        first = config.get("max_window_layers", num_layers)
        return tuple(window if i >= first else None for i in range(num_layers))
    return (window,) * num_layers


def config_from_hf(config: dict[str, Any], source: str = "config.json") -> ModelConfig:
    family = family_from_hf(config, source)
    try:
        num_heads = config["num_attention_heads"]
        hidden = config["hidden_size"]
        num_layers = config["num_hidden_layers"]
        head_dim = config.get("head_dim") or hidden // num_heads
        theta, scaling = rope_from_hf(config, source)
        eos = config.get("eos_token_id")
        model = ModelConfig(
            family=family,
            vocab_size=config["vocab_size"],
            hidden_size=hidden,
            intermediate_size=config["intermediate_size"],
            num_layers=num_layers,
            num_heads=num_heads,
            num_kv_heads=config.get("num_key_value_heads") or num_heads,
            head_dim=head_dim,
            rms_norm_eps=config.get("rms_norm_eps", 1e-6),
            rope_theta=theta,
            max_position_embeddings=config.get("max_position_embeddings", 2048),
            tie_word_embeddings=bool(config.get("tie_word_embeddings", False)),
            qkv_bias=family == "qwen2" or bool(config.get("attention_bias", False)),
            o_bias=family != "qwen2" and bool(config.get("attention_bias", False)),
            mlp_bias=bool(config.get("mlp_bias", False)),
            qk_norm=family in ("qwen3", "qwen3_moe"),
            rope_scaling=scaling,
            sliding_windows=sliding_windows_from_hf(config, family, num_layers),
            rotary_dim=rotary_dim_from_hf(config, head_dim),
            eos_token_ids=tuple(eos if isinstance(eos, list) else [] if eos is None else [eos]),
            bos_token_id=config.get("bos_token_id"),
            **moe_fields(config, family, num_layers),
        )
    except KeyError as missing:
        raise ModelLoadError(f"{source}: missing required field {missing}") from None
    return dataclasses.replace(model, **gemma_fields(config, family, hidden))


def read_hf_config(folder: Path) -> ModelConfig:
    path = folder / "config.json"
    if not path.is_file():
        raise ModelLoadError(f"{folder}: no config.json (expected a Hugging Face model folder)")
    try:
        data = json.loads(path.read_text())
    except (json.JSONDecodeError, UnicodeDecodeError) as err:
        raise ModelLoadError(f"{path}: not valid JSON ({err})") from None
    config = config_from_hf(data, str(path))
    # generation_config.json's EOS ids are the ones generation stops on.
    gen_path = folder / "generation_config.json"
    if gen_path.is_file():
        try:
            eos = json.loads(gen_path.read_text()).get("eos_token_id")
        except json.JSONDecodeError as err:
            raise ModelLoadError(f"{gen_path}: not valid JSON ({err})") from None
        if eos is not None:
            ids = tuple(eos if isinstance(eos, list) else [eos])
            config = dataclasses.replace(config, eos_token_ids=tuple(dict.fromkeys(ids + config.eos_token_ids)))
    return config
