"""The paged KV cache as device arrays: per layer, K and V pages of [num_pages, page_size, kv_heads, head_dim]."""

from __future__ import annotations

from dataclasses import dataclass

import jax
import jax.numpy as jnp

from jserve import cpu_kernels
from jserve.config import ModelConfig


@jax.tree_util.register_dataclass
@dataclass(frozen=True)
class KVPages:
    k: jax.Array  # [num_pages, page_size, num_kv_heads, head_dim]
    v: jax.Array

    @property
    def page_size(self) -> int:
        return self.k.shape[1]


KVCache = tuple[KVPages, ...]  # one entry per layer


def allocate_kv_cache(config: ModelConfig, num_pages: int, page_size: int, dtype, sharding=None) -> KVCache:
    """Zeroed pages for every layer, on the default device or laid out by `sharding` (split by KV head)."""
    shape = (num_pages, page_size, config.num_kv_heads, config.head_dim)
    if sharding is None and jax.default_backend() == "cpu" and cpu_kernels.available():
        # On CPU, writing gigabytes of zeros costs seconds of page faults; these pages stay untouched
        # until the engine first writes them.
        pages = cpu_kernels.zeros(shape, dtype, 2 * config.num_layers)
    else:
        pages = [jnp.zeros(shape, dtype, device=sharding) for _ in range(2 * config.num_layers)]
    return tuple(KVPages(pages[2 * i], pages[2 * i + 1]) for i in range(config.num_layers))


def kv_cache_bytes_per_token(config: ModelConfig, dtype) -> int:
    return 2 * config.num_layers * config.num_kv_heads * config.head_dim * jnp.dtype(dtype).itemsize
