"""A single GGUF file: its config, its tensors dequantized and renamed to the Hugging Face layout.

llama.cpp stores Llama-architecture Q/K projection rows permuted (interleaved rotary halves); they are
permuted back here, after which they equal the weights transformers loads.
"""

from __future__ import annotations

import re
from collections.abc import Iterator
from pathlib import Path

import numpy as np
from gguf import GGMLQuantizationType, GGUFReader
from gguf.quants import dequantize

from jserve.config import SUPPORTED_FAMILIES, ModelConfig, RopeScaling, sparse_layers
from jserve.errors import ModelLoadError
from jserve.loader.gguf_blocks import GgufBlocks, keeps_blocks

G = GGMLQuantizationType
SUPPORTED_TENSOR_TYPES = (
    G.F32, G.F16, G.BF16, G.Q8_0, G.Q4_0, G.Q4_1, G.Q5_0, G.Q5_1, G.Q2_K, G.Q3_K, G.Q4_K, G.Q5_K, G.Q6_K,
)  # fmt: skip
GGUF_ARCHITECTURES = {
    "llama": "llama", "qwen2": "qwen2", "qwen3": "qwen3", "phi3": "phi3", "gemma2": "gemma2", "gemma3": "gemma3",
    "qwen3moe": "qwen3_moe",
}  # fmt: skip
MOE_FAMILIES = {"llama": "mixtral"}  # llama.cpp writes Mixtral as a llama with experts
# What llama.cpp's files leave out of Gemma's settings, as its loader fixes them: every Nth layer global (Gemma
# 2: every 2nd, Gemma 3: every 6th), Gemma 3's local rope base, and the layer count of the 27B models (scaled
# by hidden / heads, the others by head_dim).
GEMMA_GLOBAL_EVERY = {"gemma2": 2, "gemma3": 6}
GEMMA3_LOCAL_ROPE_THETA = 10000.0
GEMMA_27B_LAYERS = {"gemma2": 46, "gemma3": 62}

TOP_LEVEL_NAMES = {
    "token_embd.weight": "embed_tokens.weight",
    "output_norm.weight": "norm.weight",
    "output.weight": "lm_head.weight",
}
LAYER_NAMES = {
    "attn_norm": "input_layernorm",
    "ffn_norm": "post_attention_layernorm",
    "attn_q": "self_attn.q_proj",
    "attn_k": "self_attn.k_proj",
    "attn_v": "self_attn.v_proj",
    "attn_qkv": "self_attn.qkv_proj",
    "attn_output": "self_attn.o_proj",
    "attn_q_norm": "self_attn.q_norm",
    "attn_k_norm": "self_attn.k_norm",
    "ffn_gate": "mlp.gate_proj",
    "ffn_up": "mlp.up_proj",
    "ffn_down": "mlp.down_proj",
    # mixture of experts: the router, and each projection of every expert stacked [experts, out, in]
    "ffn_gate_inp": "mlp.gate",
    "ffn_gate_exps": "mlp.experts.gate_proj",
    "ffn_up_exps": "mlp.experts.up_proj",
    "ffn_down_exps": "mlp.experts.down_proj",
}
# Older Mixtral files: one tensor per expert (blk.N.ffn_gate.E.weight), stacked by the loader (expert_tensors.py).
EXPERT_TENSOR = re.compile(r"blk\.(\d+)\.ffn_(gate|up|down)\.(\d+)\.weight")
# Where an architecture's names mean something else: Phi-3's ffn_up holds the gate's rows, then the up
# projection's; Gemma's ffn_norm comes before the MLP, and its sublayers have norms after them too.
ARCH_LAYER_NAMES = {
    "phi3": {"ffn_up": "mlp.gate_up_proj"},
    **dict.fromkeys(
        ("gemma2", "gemma3"),
        {
            "ffn_norm": "pre_feedforward_layernorm",
            "post_attention_norm": "post_attention_layernorm",
            "post_ffw_norm": "post_feedforward_layernorm",
        },
    ),
}
LAYER_TENSOR = re.compile(r"blk\.(\d+)\.(\w+)\.(weight|bias)")


class _PlainReader(GGUFReader):
    """GGUFReader slicing a plain ndarray view of its np.memmap: the memmap subclass runs Python code on
    every slice, and building SmolLM2's fields (98k vocabulary and merge strings) took 3.3 s that way,
    0.7 s this way. The parsing itself stays the library's."""

    def _get(self, offset: int, dtype, count: int = 1, override_order=None) -> np.ndarray:
        try:
            plain = self._plain
        except AttributeError:  # first call, from the base __init__
            plain = self._plain = self.data.view(np.ndarray)
        dtype, count = np.dtype(dtype), int(count)
        array = plain[offset : offset + dtype.itemsize * count].view(dtype)[:count]
        return array.view(array.dtype.newbyteorder(self.byte_order if override_order is None else override_order))


def open_gguf(path: Path) -> GGUFReader:
    try:
        return _PlainReader(path)
    except Exception as err:  # the reader raises bare ValueError/struct errors on corrupt input
        raise ModelLoadError(f"{path}: not a readable GGUF file ({type(err).__name__}: {err})") from None


def field(reader: GGUFReader, key: str, default=None):
    entry = reader.fields.get(key)
    return default if entry is None else entry.contents()


def gguf_config(reader: GGUFReader, path: Path) -> ModelConfig:
    arch = field(reader, "general.architecture")
    if arch not in GGUF_ARCHITECTURES:
        raise ModelLoadError(
            f"{path}: unsupported GGUF architecture {arch!r}; supported: {', '.join(GGUF_ARCHITECTURES)} "
            f"(jserve families: {', '.join(SUPPORTED_FAMILIES)})"
        )
    names = {t.name for t in reader.tensors}

    def meta(key, default=None):
        value = field(reader, f"{arch}.{key}", default)
        if value is None:
            raise ModelLoadError(f"{path}: GGUF metadata lacks {arch}.{key}")
        return value

    hidden, heads = meta("embedding_length"), meta("attention.head_count")
    scaling_type = field(reader, f"{arch}.rope.scaling.type", "none")
    if scaling_type not in ("none", "linear"):
        raise ModelLoadError(f"{path}: unsupported GGUF rope scaling {scaling_type!r}; supported: none, linear")
    rope_scaling = None
    if scaling_type == "linear":
        rope_scaling = RopeScaling("linear", factor=float(meta("rope.scaling.factor")))
    if "rope_factors_long.weight" in names:  # Phi-3's longrope: the factors as tensors, the rest as metadata
        rope_scaling = RopeScaling(
            "longrope",
            original_max_position_embeddings=int(meta("rope.scaling.original_context_length")),
            short_factor=tuple(float(x) for x in _tensor_by_name(reader, "rope_factors_short.weight").data),
            long_factor=tuple(float(x) for x in _tensor_by_name(reader, "rope_factors_long.weight").data),
            attention_factor=float(field(reader, f"{arch}.rope.scaling.attn_factor", 1.0)),
        )
    experts, moe = field(reader, f"{arch}.expert_count", 0), {}
    if experts:
        moe = dict(
            num_experts=experts,
            num_experts_per_tok=meta("expert_used_count"),
            moe_intermediate_size=field(reader, f"{arch}.expert_feed_forward_length") or meta("feed_forward_length"),
            norm_topk_prob=bool(field(reader, f"{arch}.expert_weights_norm", True)),  # llama.cpp's default for both
            moe_layers=sparse_layers([f"blk.{i}.ffn_gate_inp.weight" in names for i in range(meta("block_count"))]),
        )
    freq_factors = None
    if "rope_freqs.weight" in names:
        freq_factors = tuple(float(x) for x in _tensor_by_name(reader, "rope_freqs.weight").data)
    eos = [field(reader, "tokenizer.ggml.eos_token_id"), field(reader, "tokenizer.ggml.eot_token_id")]
    tokens = reader.fields.get("tokenizer.ggml.tokens")
    num_layers = meta("block_count")
    window = field(reader, f"{arch}.attention.sliding_window")
    windows = (window,) * num_layers
    gemma = {}
    if arch in GEMMA_GLOBAL_EVERY:
        every = GEMMA_GLOBAL_EVERY[arch]
        windows = tuple(None if (i + 1) % every == 0 else window for i in range(num_layers))
        head_dim = meta("attention.key_length", hidden // heads)
        gemma = dict(
            hidden_activation="gelu_tanh", embedding_multiplier=hidden**0.5, sandwich_norms=True,
            query_pre_attn_scalar=float(hidden // heads if num_layers == GEMMA_27B_LAYERS[arch] else head_dim),
            local_rope_theta=GEMMA3_LOCAL_ROPE_THETA if arch == "gemma3" else None,
            final_logit_softcapping=field(reader, f"{arch}.final_logit_softcapping"),
            attn_logit_softcapping=field(reader, f"{arch}.attn_logit_softcapping"),
        )  # fmt: skip
    return ModelConfig(
        family=MOE_FAMILIES.get(arch, GGUF_ARCHITECTURES[arch]) if experts else GGUF_ARCHITECTURES[arch],
        vocab_size=meta("vocab_size", len(tokens.data) if tokens is not None else None),
        hidden_size=hidden,
        intermediate_size=meta("feed_forward_length"),
        num_layers=num_layers,
        num_heads=heads,
        num_kv_heads=meta("attention.head_count_kv", heads),
        head_dim=meta("attention.key_length", hidden // heads),
        rms_norm_eps=float(meta("attention.layer_norm_rms_epsilon")),
        rope_theta=float(meta("rope.freq_base", 10000.0)),
        max_position_embeddings=meta("context_length", 2048),
        tie_word_embeddings="output.weight" not in names,
        qkv_bias="blk.0.attn_q.bias" in names,
        o_bias="blk.0.attn_output.bias" in names,
        mlp_bias="blk.0.ffn_up.bias" in names,
        qk_norm="blk.0.attn_q_norm.weight" in names,
        rope_scaling=rope_scaling,
        rope_freq_factors=freq_factors,
        sliding_windows=windows,
        rotary_dim=field(reader, f"{arch}.rope.dimension_count", 0),
        eos_token_ids=tuple(dict.fromkeys(i for i in eos if i is not None)),
        bos_token_id=field(reader, "tokenizer.ggml.bos_token_id"),
        **gemma,
        **moe,
    )


def _tensor_by_name(reader: GGUFReader, name: str):
    return next(t for t in reader.tensors if t.name == name)


def hf_name(gguf_name: str, arch: str = "llama") -> str | None:
    """The Hugging Face parameter name (without `model.`) for a GGUF tensor; None for tensors folded elsewhere."""
    if gguf_name in TOP_LEVEL_NAMES:
        return TOP_LEVEL_NAMES[gguf_name]
    if gguf_name in ("rope_freqs.weight", "rope_factors_long.weight", "rope_factors_short.weight"):
        return None  # folded into ModelConfig.rope_freq_factors / rope_scaling
    names = LAYER_NAMES | ARCH_LAYER_NAMES.get(arch, {})
    if expert := EXPERT_TENSOR.fullmatch(gguf_name):
        layer, projection, index = expert.groups()
        return f"layers.{layer}.mlp.experts.{index}.{projection}_proj.weight"
    match = LAYER_TENSOR.fullmatch(gguf_name)
    if match and match.group(2) in names:
        layer, kind, suffix = match.groups()
        return f"layers.{layer}.{names[kind]}.{suffix}"
    return gguf_name  # unknown: reported by the assembler as unexpected


def unpermute_rows(w: np.ndarray, num_heads: int) -> np.ndarray:
    """Undo llama.cpp's Q/K row permutation (per head: interleaved pairs -> two halves)."""
    return w.reshape(num_heads, w.shape[0] // num_heads // 2, 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def iter_gguf_tensors(
    reader: GGUFReader, config: ModelConfig, path: Path, keep_blocks: bool = False
) -> Iterator[tuple[str, np.ndarray | GgufBlocks]]:
    """(Hugging Face name, array) of each tensor, dequantized; with `keep_blocks` the 2-D ones in a format
    jserve's kernel multiplies stay in blocks (GgufBlocks)."""
    arch = field(reader, "general.architecture")
    llama_layout = arch == "llama"
    for tensor in reader.tensors:
        name = hf_name(tensor.name, arch)
        if name is None:
            continue
        if tensor.tensor_type not in SUPPORTED_TENSOR_TYPES:
            raise ModelLoadError(
                f"{path}: tensor {tensor.name!r} has unsupported GGUF type {tensor.tensor_type.name}; "
                f"supported: {', '.join(t.name for t in SUPPORTED_TENSOR_TYPES)}"
            )
        shape = tuple(int(d) for d in reversed(tensor.shape))
        if keep_blocks and keeps_blocks(tensor.tensor_type, shape):
            array = GgufBlocks(int(tensor.tensor_type), np.asarray(tensor.data).reshape(shape[0], -1), shape[1])
        else:
            array = dequantize(tensor.data, tensor.tensor_type).reshape(shape)
        if llama_layout and ".self_attn.q_proj." in name:
            array = _unpermute(array, config.num_heads)
        elif llama_layout and ".self_attn.k_proj." in name:
            array = _unpermute(array, config.num_kv_heads)
        yield name, array


def _unpermute(array: np.ndarray | GgufBlocks, num_heads: int) -> np.ndarray | GgufBlocks:
    if isinstance(array, GgufBlocks):  # whole rows move: their blocks move with them
        return array.permute_rows(lambda rows: unpermute_rows(rows, num_heads))
    return unpermute_rows(array, num_heads)
