"""Random-weight models of named real shapes (`random:llama3-8b`): for measuring speed on a model whose
checkpoint is not at hand. Weights are drawn on the device, so an 8B model never passes through host memory.
The default model's tokenizer stands in; ids past its vocabulary decode to nothing."""

from __future__ import annotations

import dataclasses
from functools import cache

import jax
import jax.numpy as jnp

from jserve.config import ModelConfig, RopeScaling
from jserve.errors import ModelLoadError
from jserve.loader.weights import abstract_model, param_name
from jserve.parallel import WeightPlacement

PREFIX = "random:"
_LLAMA3_ROPE = RopeScaling(
    "llama3", factor=8.0, low_freq_factor=1.0, high_freq_factor=4.0, original_max_position_embeddings=8192
)

MODEL_SHAPES: dict[str, ModelConfig] = {
    "llama3-8b": ModelConfig(
        family="llama", vocab_size=128256, hidden_size=4096, intermediate_size=14336, num_layers=32, num_heads=32,
        num_kv_heads=8, head_dim=128, rms_norm_eps=1e-5, rope_theta=500000.0, max_position_embeddings=131072,
        rope_scaling=_LLAMA3_ROPE,
    ),
    "qwen2.5-7b": ModelConfig(
        family="qwen2", vocab_size=152064, hidden_size=3584, intermediate_size=18944, num_layers=28, num_heads=28,
        num_kv_heads=4, head_dim=128, rms_norm_eps=1e-6, rope_theta=1000000.0, max_position_embeddings=32768,
        qkv_bias=True,
    ),
    "smollm2-135m": ModelConfig(
        family="llama", vocab_size=49152, hidden_size=576, intermediate_size=1536, num_layers=30, num_heads=9,
        num_kv_heads=3, head_dim=64, rms_norm_eps=1e-5, rope_theta=100000.0, max_position_embeddings=8192,
        tie_word_embeddings=True,
    ),
    # Published mixtures of experts, experts in every layer: 128 of 768 wide, top 8; 8 of 14336, top 2.
    "qwen3-30b-a3b": ModelConfig(
        family="qwen3_moe", vocab_size=151936, hidden_size=2048, intermediate_size=6144, num_layers=48,
        num_heads=32, num_kv_heads=4, head_dim=128, rms_norm_eps=1e-6, rope_theta=1000000.0,
        max_position_embeddings=40960, qk_norm=True, num_experts=128, num_experts_per_tok=8,
        moe_intermediate_size=768,
    ),
    "mixtral-8x7b": ModelConfig(
        family="mixtral", vocab_size=32000, hidden_size=4096, intermediate_size=14336, num_layers=32, num_heads=32,
        num_kv_heads=8, head_dim=128, rms_norm_eps=1e-5, rope_theta=1000000.0, max_position_embeddings=32768,
        num_experts=8, num_experts_per_tok=2, moe_intermediate_size=14336,
    ),
}  # fmt: skip
# A mixture of experts with SmolLM2-135M's active size: each token runs 2 of 8 experts of half its MLP width.
MODEL_SHAPES["smollm2-135m-moe"] = dataclasses.replace(
    MODEL_SHAPES["smollm2-135m"], family="mixtral", num_experts=8, num_experts_per_tok=2, moe_intermediate_size=768,
)  # fmt: skip


def shape_config(name: str) -> ModelConfig:
    """The config of a named shape (the part of `random:<shape>` after the prefix)."""
    if name not in MODEL_SHAPES:
        raise ModelLoadError(f"unknown model shape {name!r}; known: {', '.join(MODEL_SHAPES)}")
    return MODEL_SHAPES[name]


def random_params(placement: WeightPlacement, dtype, seed: int = 0):
    """(graphdef, params): norms at one, every other weight normal with std 0.02 (activations stay finite),
    each drawn where the placement puts it (with a mesh, every device draws only its shard)."""
    graphdef, abstract = abstract_model(placement.config, dtype, parallelism=placement.parallelism)
    leaves, treedef = jax.tree_util.tree_flatten_with_path(abstract)
    keys = jax.random.split(jax.random.key(seed), len(leaves))

    def draw(path, leaf, key):
        name = param_name(path)
        is_norm = name.endswith("norm.weight")
        return _sampler(leaf.shape, jnp.dtype(leaf.dtype), is_norm, placement.sharding(name))(key)

    params = [draw(path, leaf, key) for (path, leaf), key in zip(leaves, keys, strict=True)]
    return graphdef, jax.tree_util.tree_unflatten(treedef, params)


@cache
def _sampler(shape: tuple[int, ...], dtype, is_norm: bool, sharding):
    """One compiled draw per (shape, dtype, kind, sharding): ones for norms, else N(0, 0.02)."""
    if is_norm:
        return jax.jit(lambda key: jnp.ones(shape, dtype), out_shardings=sharding)
    return jax.jit(lambda key: 0.02 * jax.random.normal(key, shape, dtype), out_shardings=sharding)
