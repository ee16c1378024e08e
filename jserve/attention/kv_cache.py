"""The paged KV cache as device arrays: every layer's K pages in one array and its V pages in another.

Layer i's page p is row i * pages_per_layer + p of [num_layers * pages_per_layer, page_size, kv_heads, head_dim]:
the kernels see one larger cache, and each layer's metadata points into its own part of it
(AttentionMetadata.for_layer). Two arrays rather than two per layer, because every array a jitted step takes
and returns costs host time on every call: at 32 layers the per-layer arrays made the call cost 1.4-1.7x as much
(docs/benchmarks.md, host time per step).
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import partial

import jax
import jax.numpy as jnp

from jserve import cpu_kernels
from jserve.config import ModelConfig


@partial(jax.tree_util.register_dataclass, data_fields=["k", "v"], meta_fields=["num_layers"])
@dataclass(frozen=True)
class KVPages:
    k: jax.Array  # [num_layers * pages_per_layer, page_size, num_kv_heads, head_dim]
    v: jax.Array
    num_layers: int = 1

    @property
    def page_size(self) -> int:
        return self.k.shape[1]

    def first_page(self, layer: int) -> int:
        """Where layer `layer`'s pages start."""
        return layer * (self.k.shape[0] // self.num_layers)


KVCache = KVPages  # every layer's pages


def allocate_kv_cache(config: ModelConfig, num_pages: int, page_size: int, dtype, sharding=None) -> KVCache:
    """Zeroed pages, num_pages for every layer, on the default device or laid out by `sharding` (split by KV head)."""
    shape = (config.num_layers * num_pages, page_size, config.num_kv_heads, config.head_dim)
    if sharding is None and jax.default_backend() == "cpu" and cpu_kernels.available():
        # On CPU, writing gigabytes of zeros costs seconds of page faults; these pages stay untouched
        # until the engine first writes them.
        k, v = cpu_kernels.zeros(shape, dtype, 2)
    else:
        k, v = (jnp.zeros(shape, dtype, device=sharding) for _ in "kv")
    return KVPages(k, v, config.num_layers)


def cache_writer_compiler_options(platform: str) -> dict[str, str]:
    """XLA options for a program that takes this cache donated and writes it in place (a step).

    XLA:GPU's rematerialization pass runs before buffer assignment knows that each layer's K/V write updates
    the donated cache in place, so it counts every write as a new buffer the size of the whole cache. With a
    cache that fills the device it then sees a step needing far more memory than there is and recomputes what
    it can to save a few megabytes: for an 8B model, the attention output projection of 31 layers at 256 tokens
    a step (their weights read twice), the q/k/v projection of 31 layers at 2,048 (docs/benchmarks.md, the
    step compiled for a GPU). The step's real temporaries are small and the cache leaves room for them
    (step_workspace_bytes), so the pass is off for such programs. The CPU and TPU compilers rematerialize
    nothing here: no options there."""
    return {"xla_disable_hlo_passes": "rematerialization"} if platform == "gpu" else {}


def kv_cache_bytes_per_token(config: ModelConfig, dtype) -> int:
    return 2 * config.num_layers * config.num_kv_heads * config.head_dim * jnp.dtype(dtype).itemsize
