"""Tiny random-init checkpoints written with `transformers`, for tests that must not download anything."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import torch
import transformers
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

from jserve.engine.args import EngineArgs

VOCAB_SIZE = 320
TRAINING_TEXT = [
    "The quick brown fox jumps over the lazy dog.",
    "Paris is the capital of France; Berlin is the capital of Germany.",
    "Once upon a time there was a tiny model that lived in a test suite.",
] * 20

# family -> transformers config class, and the variants the tests cover.
FAMILIES = {
    "llama": transformers.LlamaConfig,
    "mistral": transformers.MistralConfig,
    "qwen2": transformers.Qwen2Config,
    "qwen3": transformers.Qwen3Config,
    "phi3": transformers.Phi3Config,
    "gemma2": transformers.Gemma2Config,
    "gemma3": transformers.Gemma3TextConfig,
    "mixtral": transformers.MixtralConfig,
    "qwen3_moe": transformers.Qwen3MoeConfig,
}
# longrope factors for the tiny models' 8 rotary dims of 16 (partial rotary 0.5): 4 frequencies.
LONGROPE = {"rope_type": "longrope", "rope_theta": 10000.0, "partial_rotary_factor": 0.5,
            "short_factor": [1.0, 1.3, 2.1, 3.4], "long_factor": [1.5, 2.8, 6.0, 11.0]}  # fmt: skip
VARIANTS = {
    "llama": ("llama", {}),
    "llama-tied-mqa": ("llama", {"tie_word_embeddings": True, "num_key_value_heads": 1}),
    "llama3-rope": (
        "llama",
        {
            "rope_parameters": {
                "rope_type": "llama3",
                "rope_theta": 500000.0,
                "factor": 8.0,
                "low_freq_factor": 1.0,
                "high_freq_factor": 4.0,
                "original_max_position_embeddings": 64,
            }
        },
    ),
    "llama-linear-rope": ("llama", {"rope_parameters": {"rope_type": "linear", "rope_theta": 10000.0, "factor": 4.0}}),
    "mistral-sliding": ("mistral", {"sliding_window": 12}),
    "qwen2": ("qwen2", {"tie_word_embeddings": True}),
    "qwen3": ("qwen3", {"head_dim": 32}),
    # Trained for the whole context: the short factors apply at every length (see test_models for long ones).
    "phi3": (
        "phi3",
        {
            "rope_parameters": LONGROPE | {"original_max_position_embeddings": 256},
            "original_max_position_embeddings": 256,
        },
    ),
    # Alternating sliding-window and global layers, attention scores soft-capped (at a cap the tiny model's
    # scores reach), soft-capped logits.
    "gemma2": (
        "gemma2",
        {
            "head_dim": 16,
            "query_pre_attn_scalar": 24,
            "sliding_window": 12,
            "attn_logit_softcapping": 3.0,
            "final_logit_softcapping": 30.0,
        },
    ),
    # Sliding-window and global layers with their own rope (the global one scaled), soft-capped logits.
    "gemma3": (
        "gemma3",
        {
            "head_dim": 16,
            "query_pre_attn_scalar": 24,
            "sliding_window": 12,
            "layer_types": ["sliding_attention", "full_attention"],
            "final_logit_softcapping": 30.0,
            "rope_parameters": {
                "sliding_attention": {"rope_type": "default", "rope_theta": 10000.0},
                "full_attention": {"rope_type": "linear", "rope_theta": 1e6, "factor": 8.0},
            },
        },
    ),
    # Top-2 of 4 experts in every layer, the chosen two's weights renormalized.
    "mixtral": ("mixtral", {"num_local_experts": 4, "num_experts_per_tok": 2}),
    # Top-3 of 6 narrower experts, renormalized, the second layer a dense MLP (mlp_only_layers), q/k norms.
    "qwen3_moe": (
        "qwen3_moe",
        {
            "num_experts": 6,
            "num_experts_per_tok": 3,
            "moe_intermediate_size": 48,
            "norm_topk_prob": True,
            "mlp_only_layers": [1],
            "head_dim": 32,
        },
    ),  # fmt: skip
}


def tiny_tokenizer() -> transformers.PreTrainedTokenizerFast:
    """A byte-level BPE with VOCAB_SIZE tokens, trained on a few sentences."""
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=VOCAB_SIZE, special_tokens=["<s>", "</s>"], initial_alphabet=pre_tokenizers.ByteLevel.alphabet()
    )
    tok.train_from_iterator(TRAINING_TEXT, trainer)
    return transformers.PreTrainedTokenizerFast(tokenizer_object=tok, bos_token="<s>", eos_token="</s>")


def tiny_config(family: str, **overrides) -> transformers.PretrainedConfig:
    fields = dict(
        vocab_size=VOCAB_SIZE,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=256,
        # Large enough that logits are decisive: greedy comparisons must not hinge on near-ties.
        initializer_range=0.3,
        bos_token_id=None,
        eos_token_id=None,
        pad_token_id=None,
    )
    fields.update(overrides)
    return FAMILIES[family](**fields)


def save_tiny_checkpoint(folder: Path, family: str, seed: int = 0, **overrides) -> transformers.PreTrainedModel:
    """Write config.json, model.safetensors and the tokenizer into `folder`; return the torch model."""
    torch.manual_seed(seed)
    model = transformers.AutoModelForCausalLM.from_config(tiny_config(family, **overrides), attn_implementation="eager")
    model = model.float().eval()
    model.save_pretrained(folder)
    tiny_tokenizer().save_pretrained(folder)
    return model


def reference_logits(model: transformers.PreTrainedModel, ids: list[int]) -> np.ndarray:
    with torch.no_grad():
        return model(torch.tensor([ids])).logits[0].float().numpy()


def reference_greedy(model: transformers.PreTrainedModel, ids: list[int], new_tokens: int) -> list[int]:
    with torch.no_grad():
        out = model.generate(torch.tensor([ids]), max_new_tokens=new_tokens, do_sample=False, eos_token_id=None)
    return out[0, len(ids) :].tolist()


def llama_cpp_permute(w: np.ndarray, num_heads: int) -> np.ndarray:
    """llama.cpp's Q/K row order (what its converter writes for the llama architecture)."""
    return w.reshape(num_heads, 2, w.shape[0] // num_heads // 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


GGUF_LAYER_NAMES = {
    "input_layernorm": "attn_norm",
    "post_attention_layernorm": "ffn_norm",
    "self_attn.q_proj": "attn_q",
    "self_attn.k_proj": "attn_k",
    "self_attn.v_proj": "attn_v",
    "self_attn.qkv_proj": "attn_qkv",
    "mlp.gate_up_proj": "ffn_up",
    "self_attn.o_proj": "attn_output",
    "self_attn.q_norm": "attn_q_norm",
    "self_attn.k_norm": "attn_k_norm",
    "mlp.gate_proj": "ffn_gate",
    "mlp.up_proj": "ffn_up",
    "mlp.down_proj": "ffn_down",
    "mlp.gate": "ffn_gate_inp",
}


# Gemma's norms as llama.cpp names them (its ffn_norm comes before the MLP; the sublayers have norms after).
GEMMA_GGUF_LAYER_NAMES = GGUF_LAYER_NAMES | {
    "post_attention_layernorm": "post_attention_norm",
    "pre_feedforward_layernorm": "ffn_norm",
    "post_feedforward_layernorm": "post_ffw_norm",
}


def gguf_tensor_name(hf_name: str, arch: str = "llama") -> str:
    name = hf_name.removeprefix("model.")
    top = {
        "embed_tokens.weight": "token_embd.weight",
        "norm.weight": "output_norm.weight",
        "lm_head.weight": "output.weight",
    }
    if name in top:
        return top[name]
    _, layer, rest = name.split(".", 2)
    module, suffix = rest.rsplit(".", 1)
    names = GEMMA_GGUF_LAYER_NAMES if arch in ("gemma2", "gemma3") else GGUF_LAYER_NAMES
    return f"blk.{layer}.{names[module]}.{suffix}"


def gguf_tensors(name: str, w: np.ndarray, arch: str, split_experts: bool) -> list[tuple[str, np.ndarray]]:
    """A transformers tensor as llama.cpp names it; its fused experts (gate_up_proj [E, 2I, H], down_proj)
    as stacked ffn_*_exps tensors or one per expert."""
    if ".mlp.experts." not in name:
        return [(gguf_tensor_name(name, arch), w)]
    layer = name.removeprefix("model.").split(".")[1]
    pieces = (
        dict(zip(("gate", "up"), np.split(w, 2, axis=1), strict=True)) if name.endswith("gate_up_proj") else {"down": w}
    )
    if split_experts:
        return [(f"blk.{layer}.ffn_{p}.{e}.weight", x[e]) for p, x in pieces.items() for e in range(len(x))]
    return [(f"blk.{layer}.ffn_{p}_exps.weight", x) for p, x in pieces.items()]


def quantize_blocks(w: np.ndarray, qtype) -> np.ndarray:
    """w [..., n] in ggml's block format `qtype`: gguf-py's quantizer, and for Q4_K, Q5_K and Q6_K (which
    gguf-py only dequantizes) a plain round-to-nearest encoder of their layouts (n a multiple of 256)."""
    import gguf
    from gguf.quants import quantize

    if qtype in (gguf.GGMLQuantizationType.Q4_K, gguf.GGMLQuantizationType.Q5_K):
        return _q4_k(w, bits=4 if qtype == gguf.GGMLQuantizationType.Q4_K else 5)
    if qtype == gguf.GGMLQuantizationType.Q6_K:
        return _q6_k(w)
    return quantize(w, qtype)


def _q4_k(w: np.ndarray, bits: int = 4) -> np.ndarray:
    """Q4_K, or with bits=5 Q5_K (the same with a 5th bit per code in 32 bytes before the nibbles)."""
    top = 2**bits - 1
    x = w.reshape(-1, 8, 32)  # super-blocks of 8 sub-blocks
    low, high = np.minimum(x.min(-1), 0), np.maximum(x.max(-1), 0)
    d = ((high - low).max(-1) / top / 63).astype(np.float16)
    dmin = ((-low).max(-1) / 63).astype(np.float16)
    d32, dmin32 = (np.where(v == 0, 1, v).astype(np.float32)[:, None] for v in (d, dmin))
    sc = np.clip(np.rint((high - low) / top / d32), 0, 63).astype(np.uint8)
    m = np.clip(np.rint(-low / dmin32), 0, 63).astype(np.uint8)
    d1, m1 = (d.astype(np.float32)[:, None] * sc)[..., None], (dmin.astype(np.float32)[:, None] * m)[..., None]
    q = np.clip(np.rint((x + m1) / np.where(d1 == 0, 1, d1)), 0, top).astype(np.uint8)
    packed = np.zeros((len(x), 12), np.uint8)  # ggml's get_scale_min_k4, inverted
    packed[:, :4] = (sc[:, :4] & 63) | ((sc[:, 4:] >> 4) << 6)
    packed[:, 4:8] = (m[:, :4] & 63) | ((m[:, 4:] >> 4) << 6)
    packed[:, 8:] = (sc[:, 4:] & 0xF) | ((m[:, 4:] & 0xF) << 4)
    nibbles = q & 0xF
    codes = (nibbles[:, 0::2] | (nibbles[:, 1::2] << 4)).reshape(len(x), 128)  # chunk c: sub-blocks 2c, 2c + 1
    fifth = [((q[:, j] >> 4) << j).astype(np.uint8) for j in range(8)] if bits == 5 else []  # bit j: sub-block j
    heads = [d.view(np.uint8).reshape(-1, 2), dmin.view(np.uint8).reshape(-1, 2), packed]
    blocks = np.concatenate([*heads, *([np.bitwise_or.reduce(fifth)] if fifth else []), codes], -1)
    return blocks.reshape(*w.shape[:-1], -1)


def _q6_k(w: np.ndarray) -> np.ndarray:
    x = w.reshape(-1, 16, 16)  # super-blocks of 16 sub-blocks
    sub = np.abs(x).max(-1) / 31
    d = (sub.max(-1) / 127).astype(np.float16)
    d32 = np.where(d == 0, 1, d).astype(np.float32)[:, None]
    sc = np.clip(np.rint(sub / d32), -128, 127).astype(np.int8)
    step = (d.astype(np.float32)[:, None] * sc)[..., None]
    q = (np.clip(np.rint(x / np.where(step == 0, 1, step)), -32, 31) + 32).astype(np.uint8).reshape(-1, 2, 4, 32)
    low = (q[:, :, :2] & 0xF) | ((q[:, :, 2:] & 0xF) << 4)  # [.., half, l4 row (0: q1|q3, 1: q2|q4), 32]
    high = q[:, :, 0] >> 4 | (q[:, :, 1] >> 4) << 2 | (q[:, :, 2] >> 4) << 4 | (q[:, :, 3] >> 4) << 6
    blocks = np.concatenate(
        [low.reshape(-1, 128), high.reshape(-1, 64), sc.view(np.uint8), d.view(np.uint8).reshape(-1, 2)], -1
    )
    return blocks.reshape(*w.shape[:-1], -1)


def write_gguf(
    model: transformers.PreTrainedModel,
    folder: Path,
    path: Path,
    arch: str = "llama",
    qtype=None,
    float_dtype=np.float32,
    split_experts: bool = False,
) -> None:
    """Write `model` (saved with its tokenizer in `folder`) as a GGUF file the way llama.cpp lays it out.

    2-D weights are stored as `qtype` (e.g. Q8_0, or a function of the GGUF tensor name) when given,
    everything else as `float_dtype`. Experts are stacked per projection (ffn_gate_exps), or one tensor per
    expert (blk.N.ffn_gate.E) if `split_experts`, as older Mixtral files have them.
    """
    import gguf

    cfg = model.config
    writer = gguf.GGUFWriter(str(path), arch)
    writer.add_block_count(cfg.num_hidden_layers)
    writer.add_context_length(cfg.max_position_embeddings)
    writer.add_embedding_length(cfg.hidden_size)
    writer.add_feed_forward_length(cfg.intermediate_size)
    writer.add_head_count(cfg.num_attention_heads)
    writer.add_head_count_kv(cfg.num_key_value_heads)
    head_dim = getattr(cfg, "head_dim", None) or cfg.hidden_size // cfg.num_attention_heads
    writer.add_key_length(head_dim)
    writer.add_value_length(head_dim)
    rope = cfg.rope_parameters.get("full_attention", cfg.rope_parameters)  # Gemma 3: the global layers'
    writer.add_rope_freq_base(rope["rope_theta"])
    if rope.get("rope_type") == "linear":
        writer.add_rope_scaling_type(gguf.RopeScalingType.LINEAR)
        writer.add_rope_scaling_factor(rope["factor"])
    writer.add_layer_norm_rms_eps(cfg.rms_norm_eps)
    writer.add_vocab_size(cfg.vocab_size)
    if getattr(cfg, "num_local_experts", None):
        writer.add_expert_count(cfg.num_local_experts)
        writer.add_expert_used_count(cfg.num_experts_per_tok)
        if hasattr(cfg, "moe_intermediate_size"):
            writer.add_expert_feed_forward_length(cfg.moe_intermediate_size)

    tokenizer = Tokenizer.from_file(str(folder / "tokenizer.json"))
    vocab = sorted(tokenizer.get_vocab(with_added_tokens=True).items(), key=lambda item: item[1])
    model_json = __import__("json").loads(tokenizer.to_str())["model"]
    writer.add_tokenizer_model("gpt2")
    writer.add_tokenizer_pre("default")
    writer.add_token_list([token for token, _ in vocab])
    writer.add_token_types([3 if token in ("<s>", "</s>") else 1 for token, _ in vocab])
    writer.add_token_merges([m if isinstance(m, str) else " ".join(m) for m in model_json["merges"]])
    writer.add_bos_token_id(tokenizer.token_to_id("<s>"))
    writer.add_eos_token_id(tokenizer.token_to_id("</s>"))
    writer.add_add_bos_token(False)

    if cfg.rope_parameters.get("rope_type") == "llama3":
        # llama.cpp carries Llama 3.x rope scaling as per-frequency divisors, not as metadata.
        from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

        scaled, _ = ROPE_INIT_FUNCTIONS["llama3"](cfg)
        head_dim = cfg.hidden_size // cfg.num_attention_heads
        default = 1.0 / (cfg.rope_parameters["rope_theta"] ** (np.arange(0, head_dim, 2, dtype=np.float32) / head_dim))
        writer.add_tensor("rope_freqs.weight", (default / scaled.numpy()).astype(np.float32))

    if arch in ("gemma2", "gemma3"):  # llama.cpp fixes the layer pattern and Gemma 3's local rope base itself
        writer.add_sliding_window(cfg.sliding_window)
        if cfg.final_logit_softcapping is not None:
            writer.add_final_logit_softcapping(cfg.final_logit_softcapping)
        if getattr(cfg, "attn_logit_softcapping", None) is not None:
            writer.add_attn_logit_softcapping(cfg.attn_logit_softcapping)
    rope = cfg.rope_parameters
    if rope.get("rope_type") == "longrope":  # as llama.cpp writes Phi-3: the factors as tensors
        writer.add_rope_dimension_count(int(head_dim * rope.get("partial_rotary_factor", 1.0)))
        writer.add_rope_scaling_orig_ctx_len(rope["original_max_position_embeddings"])
        from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

        writer.add_rope_scaling_attn_factors(ROPE_INIT_FUNCTIONS["longrope"](cfg)[1])
        writer.add_tensor("rope_factors_long.weight", np.array(rope["long_factor"], np.float32))
        writer.add_tensor("rope_factors_short.weight", np.array(rope["short_factor"], np.float32))

    for name, tensor in model.state_dict().items():
        if name == "lm_head.weight" and cfg.tie_word_embeddings:
            continue
        w = tensor.float().numpy().astype(float_dtype)
        if arch in ("gemma2", "gemma3") and name.endswith("norm.weight"):
            w = w + 1  # llama.cpp stores Gemma's (1 + w) scales
        if arch == "llama" and ".q_proj." in name:
            w = llama_cpp_permute(w, cfg.num_attention_heads)
        elif arch == "llama" and ".k_proj." in name:
            w = llama_cpp_permute(w, cfg.num_key_value_heads)
        for gguf_name, array in gguf_tensors(name, w, arch, split_experts):
            if qtype is not None and array.ndim >= 2:
                kind = qtype(gguf_name) if callable(qtype) else qtype
                writer.add_tensor(gguf_name, quantize_blocks(array.astype(np.float32), kind), raw_dtype=kind)
            else:
                writer.add_tensor(gguf_name, array)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()


def tiny_kv_bytes(pages: int, page_size: int = 16) -> int:
    """kv_cache_memory for `pages` pages of the tiny models (2 layers, 2 KV heads of 16 dims, float32)."""
    return pages * page_size * 2 * 2 * 2 * 16 * 4


def tiny_engine_args(folder, **overrides) -> EngineArgs:
    """A tiny checkpoint's engine, small enough to start in seconds."""
    settings = dict(model=str(folder), dtype="float32", max_model_len=256, max_num_seqs=8, max_num_batched_tokens=64,
                    kv_cache_memory=tiny_kv_bytes(64), enable_prefix_caching=False)  # fmt: skip
    return EngineArgs(**settings | overrides)


def assert_engine_idle(llm) -> None:
    """Nothing queued or running, every slot free, and every KV page back in the pool or held, unlocked, by
    the prefix cache (whose every invariant holds)."""
    assert not llm.engine.has_unfinished_requests()
    llm.engine.scheduler.check_idle()


def jserve_prompt_logits(model, prompt_ids: list[int], attention=None) -> np.ndarray:
    """jserve's float32 logits [len(prompt), vocab] at every prompt position, from one model step
    (on the model's mesh when it is tensor-parallel: the cache split by KV head, the batch replicated)."""
    import jax
    from jax.sharding import NamedSharding, PartitionSpec

    from jserve.attention import SequenceChunk, allocate_kv_cache, build_model_input
    from jserve.parallel import kv_cache_spec

    mesh = model.mesh
    n, page_size = len(prompt_ids), 16
    pages = np.arange(-(-n // page_size), dtype=np.int32)
    kv_sharding = NamedSharding(mesh, kv_cache_spec()) if mesh else None
    kv = allocate_kv_cache(model.config, len(pages), page_size, model.dtype, kv_sharding)
    padded = max(16, 1 << (n - 1).bit_length())
    batch = build_model_input([SequenceChunk(np.asarray(prompt_ids), 0, pages)], page_size, padded, 1, len(pages), True)
    batch = jax.device_put(batch, NamedSharding(mesh, PartitionSpec()) if mesh else None)
    logits, _ = model_forward(model, kv, batch, attention)
    return np.asarray(logits)


def model_forward(model, kv, batch, attention=None):
    """(logits, KV cache) of one batch through `jserve.models.forward`, the function the engine's step runs
    the model with, jitted here on its own (the reference attention unless `attention` is given)."""
    import jax

    from jserve.attention import REFERENCE
    from jserve.models import forward

    return jax.jit(forward, static_argnums=(0, 4))(model.graphdef, model.params, kv, batch, attention or REFERENCE)


def release_compiled() -> None:
    """JAX's caches keep every compiled step alive after its engine is gone, and each CPU executable holds
    memory mappings of its own (about 2,000 an engine with a draft model): a whole suite's worth ran into the
    kernel's 65530-mapping limit (XLA aborts). Dropping them frees those of engines that are gone; live
    engines keep theirs."""
    import gc

    import jax

    gc.collect()
    jax.clear_caches()
