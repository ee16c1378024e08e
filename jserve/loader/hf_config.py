"""A Hugging Face config.json read as transformers reads it: every form the hub has published, into a ModelConfig.

Fields a file leaves out take transformers' defaults for its family (hf_defaults.py); layers' attention kinds
follow transformers' pattern for the family where the file names none (Gemma 2 alternates, Gemma 3 has a
global layer every sliding_window_pattern, Qwen slides from max_window_layers on, Mistral/Mixtral/Phi-3
slide everywhere, Llama never); a multimodal checkpoint's `text_config` describes the model jserve serves.
"""

from __future__ import annotations

import dataclasses
import json
import logging
import math
from pathlib import Path
from typing import Any

from jserve.config import (
    GEMMA_FAMILIES,
    SUPPORTED_FAMILIES,
    SUPPORTED_ROPE_TYPES,
    ModelConfig,
    RopeScaling,
    sparse_layers,
)
from jserve.errors import ModelLoadError
from jserve.loader.hf_defaults import HF_DEFAULTS

log = logging.getLogger("jserve")

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
# Image-and-text checkpoints whose text model jserve serves (its vision tower is not loaded).
MULTIMODAL_ARCHITECTURES = {"Gemma3ForConditionalGeneration": "gemma3"}
MODEL_TYPES = {"gemma3_text": "gemma3"}  # config.json model_type -> family, where they differ
ROPE_TYPE_ALIASES = {"su": "longrope"}  # Phi-3's first configs
QWEN_FAMILIES = ("qwen2", "qwen3", "qwen3_moe")


def text_model_fields(config: dict[str, Any], source: str) -> dict[str, Any]:
    """The fields of the language model: a multimodal checkpoint's `text_config` over its top level (which
    holds the architecture and the token ids), else the config itself."""
    if "text_config" not in config:
        return config
    names = [name for name in config.get("architectures") or () if name in MULTIMODAL_ARCHITECTURES]
    if not names:
        raise ModelLoadError(
            f"{source}: multimodal architecture {config.get('architectures')!r} is not supported; "
            f"supported: {', '.join(MULTIMODAL_ARCHITECTURES)} (its text model)"
        )
    log.info("%s: %s: serving its text model; the vision tower is not loaded (text-only requests)", source, names[0])
    outer = {k: v for k, v in config.items() if k not in ("text_config", "vision_config", "model_type")}
    return outer | config["text_config"]


def family_from_hf(config: dict[str, Any], source: str) -> str:
    for name in config.get("architectures") or ():
        if name in HF_ARCHITECTURES or name in MULTIMODAL_ARCHITECTURES:
            return HF_ARCHITECTURES.get(name) or MULTIMODAL_ARCHITECTURES[name]
    model_type = MODEL_TYPES.get(config.get("model_type"), config.get("model_type"))
    if model_type in SUPPORTED_FAMILIES:
        return model_type
    found = config.get("architectures") or model_type
    raise ModelLoadError(
        f"{source}: unsupported architecture {found!r}; supported: {', '.join(sorted(HF_ARCHITECTURES))} "
        f"(model_type {', '.join(SUPPORTED_FAMILIES)})"
    )


def rope_from_hf(config: dict[str, Any], source: str) -> tuple[float, RopeScaling | None]:
    """(rope_theta, scaling) from either transformers 5's `rope_parameters` or the older `rope_scaling`;
    for Gemma 3 those of its global layers (its sliding layers' rope: gemma_fields)."""
    params = dict(config.get("rope_parameters") or config.get("rope_scaling") or {})
    params = params.get("full_attention", params)  # per layer type: the global layers'
    theta = float(params.get("rope_theta", config["rope_theta"]))
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
    max_positions = config["max_position_embeddings"]
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
    local = (params.get("sliding_attention") or {}).get("rope_theta", config.get("rope_local_base_freq"))
    return dict(
        hidden_activation="gelu_tanh",
        embedding_multiplier=hidden**0.5,
        sandwich_norms=True,
        query_pre_attn_scalar=float(config["query_pre_attn_scalar"]),
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
    fields = dict(num_experts=experts, num_experts_per_tok=config["num_experts_per_tok"])
    if family == "mixtral":  # every layer, experts as wide as the intermediate size, top-k renormalized
        return fields | dict(moe_intermediate_size=config["intermediate_size"])
    # Qwen3-MoE: every decoder_sparse_step-th layer not listed in mlp_only_layers
    step, dense = config["decoder_sparse_step"], set(config["mlp_only_layers"] or ())
    return fields | dict(
        moe_intermediate_size=config["moe_intermediate_size"],
        norm_topk_prob=bool(config["norm_topk_prob"]),
        moe_layers=sparse_layers([i not in dense and (i + 1) % step == 0 for i in range(num_layers)]),
    )


def rotary_dim_from_hf(config: dict[str, Any], head_dim: int) -> int:
    params = config.get("rope_parameters") or config.get("rope_scaling") or {}
    factor = params.get("partial_rotary_factor", config["partial_rotary_factor"])
    return int(head_dim * factor)


def sliding_layers(config: dict[str, Any], family: str, num_layers: int) -> list[bool]:
    """Which layers attend within the window, by transformers' pattern for the family."""
    layers = range(num_layers)
    if config.get("layer_types") is not None and family in GEMMA_FAMILIES + ("qwen2", "qwen3"):
        return [kind == "sliding_attention" for kind in config["layer_types"]]
    if family == "llama":  # Llama has no sliding window, whatever the file says
        return [False for _ in layers]
    if family == "gemma2":  # even layers slide, odd ones are global
        return [(i + 1) % 2 != 0 for i in layers]
    if family == "gemma3":  # one global layer in every sliding_window_pattern
        return [(i + 1) % config["sliding_window_pattern"] != 0 for i in layers]
    if family in ("qwen2", "qwen3"):
        return [i >= config["max_window_layers"] for i in layers]
    return [True for _ in layers]  # mistral, mixtral, phi3, qwen3_moe: every layer


def sliding_windows_from_hf(config: dict[str, Any], family: str, num_layers: int) -> tuple[int | None, ...]:
    window = config["sliding_window"]
    if family in QWEN_FAMILIES and not config["use_sliding_window"]:
        window = None  # Qwen's window applies only where the config turns it on
    if window is None:
        return (None,) * num_layers
    return tuple(window if sliding else None for sliding in sliding_layers(config, family, num_layers))


def config_from_hf(config: dict[str, Any], source: str = "config.json") -> ModelConfig:
    text = text_model_fields(config, source)
    family = family_from_hf(text, source)
    config = HF_DEFAULTS[family] | text
    try:
        num_heads = config["num_attention_heads"]
        hidden = config["hidden_size"]
        num_layers = config["num_hidden_layers"]
        head_dim = config["head_dim"] or hidden // num_heads
        theta, scaling = rope_from_hf(config, source)
        eos = config["eos_token_id"]
        model = ModelConfig(
            family=family,
            vocab_size=config["vocab_size"],
            hidden_size=hidden,
            intermediate_size=config["intermediate_size"],
            num_layers=num_layers,
            num_heads=num_heads,
            num_kv_heads=config["num_key_value_heads"] or num_heads,
            head_dim=head_dim,
            rms_norm_eps=config["rms_norm_eps"],
            rope_theta=theta,
            max_position_embeddings=config["max_position_embeddings"],
            tie_word_embeddings=bool(config["tie_word_embeddings"]),
            qkv_bias=family == "qwen2" or bool(config["attention_bias"]),
            o_bias=family != "qwen2" and bool(config["attention_bias"]),
            mlp_bias=bool(config["mlp_bias"]),
            qk_norm=family in ("qwen3", "qwen3_moe"),
            rope_scaling=scaling,
            sliding_windows=sliding_windows_from_hf(config, family, num_layers),
            rotary_dim=rotary_dim_from_hf(config, head_dim),
            eos_token_ids=tuple(eos if isinstance(eos, list) else [] if eos is None else [eos]),
            bos_token_id=config["bos_token_id"],
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
