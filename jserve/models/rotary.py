"""Rotary position embedding (half-rotation layout, over all or the leading `rotary_dim` dims of each head),
with `linear`, Llama 3.x `llama3` and Phi-3 `longrope` frequency scaling."""

from __future__ import annotations

import dataclasses
import math

import jax
import jax.numpy as jnp
import numpy as np

from jserve.config import ModelConfig, RopeScaling


def inverse_frequencies(config: ModelConfig) -> np.ndarray:
    """[rotary_dim // 2] float32 inverse frequencies, scaled as the config asks."""
    dim = config.rotary_dim
    inv_freq = 1.0 / (np.float32(config.rope_theta) ** (np.arange(0, dim, 2, dtype=np.float32) / np.float32(dim)))
    if config.rope_scaling is not None:
        inv_freq = _scale(inv_freq, config.rope_scaling)
    if config.rope_freq_factors is not None:
        inv_freq = inv_freq / np.asarray(config.rope_freq_factors, np.float32)
    return inv_freq.astype(np.float32)


def sliding_layers_rope(config: ModelConfig) -> ModelConfig:
    """The config sliding-window layers rotate by: Gemma 3's local base, unscaled; the model's own otherwise."""
    if config.local_rope_theta is None:
        return config
    return dataclasses.replace(config, rope_theta=config.local_rope_theta, rope_scaling=None)


def attention_factor(config: ModelConfig) -> float:
    """What cos and sin are scaled by (longrope's attention factor; 1 otherwise)."""
    return config.rope_scaling.attention_factor if config.rope_scaling is not None else 1.0


def _scale(inv_freq: np.ndarray, scaling: RopeScaling) -> np.ndarray:
    if scaling.rope_type == "linear":
        return inv_freq / np.float32(scaling.factor)
    if scaling.rope_type == "longrope":
        factors = scaling.long_factor if scaling.long else scaling.short_factor
        return (inv_freq / np.asarray(factors, np.float32)).astype(np.float32)
    # llama3: keep high frequencies, divide low ones by `factor`, blend smoothly in between.
    old_len = scaling.original_max_position_embeddings
    low_wavelen = old_len / scaling.low_freq_factor
    high_wavelen = old_len / scaling.high_freq_factor
    wavelen = 2 * math.pi / inv_freq
    scaled = np.where(wavelen > low_wavelen, inv_freq / scaling.factor, inv_freq)
    smooth = (old_len / wavelen - scaling.low_freq_factor) / (scaling.high_freq_factor - scaling.low_freq_factor)
    blended = (1 - smooth) * scaled / scaling.factor + smooth * scaled
    is_medium = (wavelen >= high_wavelen) & (wavelen <= low_wavelen)
    return np.where(is_medium, blended, scaled).astype(np.float32)


def rope_angles(positions: jax.Array, inv_freq: np.ndarray, scale: float = 1.0) -> tuple[jax.Array, jax.Array]:
    """(cos, sin) times `scale`, each [T, rotary_dim], for the tokens' positions; computed once per step,
    shared by all layers."""

    def tables(positions: jax.Array) -> tuple[jax.Array, jax.Array]:
        freqs = positions.astype(jnp.float32)[:, None] * jnp.asarray(inv_freq)[None, :]
        angles = jnp.concatenate([freqs, freqs], axis=-1)
        return jnp.cos(angles) * scale, jnp.sin(angles) * scale  # (XLA drops a scale of 1)

    # XLA fuses cos/sin into every consumer, evaluating them again for each head of each layer's q and k
    # (11 of a 64-token step's ~240 ms on CPU); a conditional's results are buffers, computed once. Its
    # predicate always holds (positions are never negative), but the compiler cannot know that.
    return jax.lax.cond(positions[0] >= 0, tables, tables, positions)


@jax.named_scope("rope")  # (scopes name the step's parts in profiles: benchmarks/step_profile.py)
def apply_rope(x: jax.Array, cos: jax.Array, sin: jax.Array) -> jax.Array:
    """x [T, heads, head_dim] rotated by its token's angles (its leading cos.shape[-1] dims; the rest pass)."""
    dim = cos.shape[-1]
    if dim < x.shape[-1]:
        return jnp.concatenate([apply_rope(x[..., :dim], cos, sin), x[..., dim:]], axis=-1)
    half = dim // 2
    x32 = x.astype(jnp.float32)
    rotated = jnp.concatenate([-x32[..., half:], x32[..., :half]], axis=-1)
    return (x32 * cos[:, None, :] + rotated * sin[:, None, :]).astype(x.dtype)
