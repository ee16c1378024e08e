"""`--quantization gguf`: a GGUF file's weights kept in their block formats, multiplied by jserve's C++
kernel, against the same file dequantized to float32 (the exact path): same weights, and activations exact
to 2⁻²² of each 32 inputs' largest, so logits within 1e-3 (SmolLM2 measured 1.9e-4) and the same greedy
tokens."""

import gguf
import jax
import numpy as np
import pytest
from flax import nnx
from gguf.quants import dequantize

from jserve import LLM, SamplingParams, cpu_kernels
from jserve.loader import load_model

from test_engine import prompts, token_ids
from tiny_models import (
    VARIANTS,
    jserve_prompt_logits,
    quantize_blocks,
    save_tiny_checkpoint,
    tiny_engine_args,
    write_gguf,
)

pytestmark = pytest.mark.skipif(not cpu_kernels.available(), reason="needs a C++ compiler to build jserve's kernels")
CHAT = ["What is the capital of France?", "Write a haiku about the sea.", "Name three prime numbers."]


def block_weights(loaded) -> dict[str, tuple | int]:
    """A loaded model's weights held as GGUF blocks: each Linear's segments, an Embedding's format."""
    held = {}
    for path, node in nnx.iter_graph(nnx.merge(loaded.graphdef, loaded.params)):
        layout = getattr(node, "segments", None) or getattr(node, "ggml_type", None)
        if layout is not None:
            held[".".join(map(str, path))] = layout
    return held


def test_default_model_keeps_its_blocks_and_float32s_logits(smollm2_gguf_path, smollm2):
    native = load_model(smollm2_gguf_path, "float32", quantization="gguf")
    held = block_weights(native)
    assert held["embed_tokens"] == gguf.GGMLQuantizationType.Q8_0  # the tied table and head
    assert held["layers.0.self_attn.qkv_proj"] == ((gguf.GGMLQuantizationType.Q4_1, 576 + 2 * 192),)
    assert len(held) == 1 + 30 * 4  # the table; q/k/v, o, gate/up and down in each layer
    nbytes = [sum(leaf.nbytes for leaf in jax.tree.leaves(m.params)) for m in (smollm2, native)]
    assert nbytes[1] < 0.2 * nbytes[0]  # about the file's size, not float32's
    ids = smollm2.tokenizer.encode(
        "<|im_start|>user\nWhat is the capital of France?<|im_end|>\n<|im_start|>assistant\n"
    )
    got, expected = jserve_prompt_logits(native, ids), jserve_prompt_logits(smollm2, ids)
    np.testing.assert_allclose(got, expected, atol=1e-3, rtol=0)


def test_default_model_greedy_replies_equal_float32s():
    params = SamplingParams(temperature=0, max_tokens=48)
    messages = [[{"role": "user", "content": text}] for text in CHAT]
    replies = {}
    for quantization in ("none", "gguf"):
        llm = LLM(quantization=quantization, max_model_len=512, max_num_seqs=4)
        replies[quantization] = token_ids(llm.chat(messages, params, use_tqdm=False))
    assert replies["gguf"] == replies["none"]


def assert_blocks_match_the_dequantized_file(path, native, exact):
    """The block weights' prompt logits within 1e-3 of the file dequantized, and the engine's greedy tokens
    the same on both paths."""
    ids = prompts(1, seed=4, low=30, high=31)[0]
    np.testing.assert_allclose(jserve_prompt_logits(native, ids), jserve_prompt_logits(exact, ids), atol=1e-3)
    batch = prompts(4, seed=5, low=5, high=60)
    params = SamplingParams(temperature=0, max_tokens=16, ignore_eos=True)
    outputs = {}
    for quantization in ("none", "gguf"):
        args = tiny_engine_args(path, quantization=quantization)
        outputs[quantization] = token_ids(LLM.from_engine_args(args).generate(batch, params, use_tqdm=False))
    assert outputs["gguf"] == outputs["none"]


@pytest.mark.parametrize(
    "variant, qtype",
    [("llama", "Q8_0"), ("qwen2", "Q4_0"), ("phi3", "Q5_0"), ("llama-tied-mqa", "Q4_1"), ("qwen2", "Q5_1")],
)
def test_tiny_gguf_blocks_give_the_dequantized_logits_and_tokens(tmp_path, variant, qtype):
    """llama: Q/K rows permuted in the file; qwen2: q/k/v biases and a tied head; phi3: fused q/k/v and
    gate/up tensors split into blocks; MQA with a tied table in Q4_1; each 32-weight format at least once."""
    family, overrides = VARIANTS[variant]
    torch_model = save_tiny_checkpoint(tmp_path / "hf", family, **overrides)
    qtype = gguf.GGMLQuantizationType[qtype]
    write_gguf(torch_model, tmp_path / "hf", tmp_path / "model.gguf", arch=family, qtype=qtype)
    exact = load_model(tmp_path / "model.gguf", "float32")
    native = load_model(tmp_path / "model.gguf", "float32", quantization="gguf")
    assert len(block_weights(native)) == 1 + 2 * 4 + (not native.config.tie_word_embeddings)
    assert_blocks_match_the_dequantized_file(tmp_path / "model.gguf", native, exact)


def k_quant_mix(main: str):
    """What llama.cpp's Q4_K_M and Q5_K_M mostly pick: Q6_K for the value and down projections, the main
    K-quant elsewhere."""
    G = gguf.GGMLQuantizationType
    return lambda name: G.Q6_K if "attn_v" in name or "ffn_down" in name else G[main]


@pytest.mark.parametrize("variant, main", [("llama", "Q4_K"), ("llama-tied-mqa", "Q5_K")])
def test_k_quant_blocks_give_the_dequantized_logits_and_tokens(tmp_path, variant, main):
    """A Q4_K_M- or Q5_K_M-like file (rows 256 wide and more, as K-quants need): K-quant pieces of two
    formats fused in one q/k/v weight, a K-quant table (tied: the head too)."""
    G = gguf.GGMLQuantizationType
    family, overrides = VARIANTS[variant]
    torch_model = save_tiny_checkpoint(tmp_path / "hf", family, hidden_size=256, intermediate_size=512, **overrides)
    w = torch_model.model.layers[0].mlp.down_proj.weight.detach().numpy()
    for qtype, error in ((G.Q4_K, 0.1), (G.Q5_K, 0.05), (G.Q6_K, 0.02)):  # the test's own encoders
        back = dequantize(quantize_blocks(w, qtype), qtype).reshape(w.shape)
        assert np.abs(back - w).max() < error * np.abs(w).max()
    write_gguf(torch_model, tmp_path / "hf", tmp_path / "model.gguf", arch=family, qtype=k_quant_mix(main))
    exact = load_model(tmp_path / "model.gguf", "float32")
    native = load_model(tmp_path / "model.gguf", "float32", quantization="gguf")
    held = block_weights(native)
    q, kv = 256, 64 * torch_model.config.num_key_value_heads
    assert held["layers.0.self_attn.qkv_proj"] == ((G[main], q + kv), (G.Q6_K, kv))
    assert held["embed_tokens"] == G[main]
    assert_blocks_match_the_dequantized_file(tmp_path / "model.gguf", native, exact)


def test_gguf_blocks_need_a_gguf_file_and_float32(tmp_path, tiny_llama_checkpoint):
    with pytest.raises(ValueError, match="is not a GGUF file"):
        load_model(tiny_llama_checkpoint[0], "float32", quantization="gguf")
    write_gguf(tiny_llama_checkpoint[1], tiny_llama_checkpoint[0], tmp_path / "model.gguf")
    with pytest.raises(ValueError, match="need --dtype float32"):
        load_model(tmp_path / "model.gguf", "bfloat16", quantization="gguf")
