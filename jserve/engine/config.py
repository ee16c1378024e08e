"""Engine settings, resolved once from the user's arguments, the model and the device."""

from __future__ import annotations

import logging
import os
from dataclasses import dataclass

import jax
import jax.numpy as jnp

from jserve.attention import kv_cache_bytes_per_token
from jserve.config import ModelConfig

log = logging.getLogger("jserve")

GiB = 1 << 30
MIN_TOKEN_BUCKET = 16
# One sequence decoding (a notebook, a chat) runs unpadded instead of padding to 16. On CPU a lone decode
# measured 12.7 ms a step at 1 token vs 14.5 at 2 with int8 weights, 27.3 vs 41.9 ms in float32
# (docs/benchmarks.md). Buckets 2, 4 and 8 would help a few concurrent decodes, but each bucket adds
# compile time to every start-up.
SINGLE_DECODE_BUCKET = 1
SCHEDULE_POLICIES = ("fcfs", "lpm", "priority")  # only "priority" honours a request's priority


@dataclass(frozen=True)
class EngineConfig:
    max_model_len: int
    max_num_seqs: int
    max_num_batched_tokens: int
    page_size: int
    num_pages: int
    seed: int = 0
    enable_prefix_caching: bool = True
    schedule_policy: str = "fcfs"  # "lpm": longest cached prefix first; "priority": (priority, arrival)
    attention_backend: str = "auto"  # resolved (and checked) by jserve.attention.resolve_attention_backend
    async_scheduling: bool = True  # prepare step N+1 while the device runs step N (identical outputs)
    kv_cache_dtype: str = "float32"  # the pages' dtype: the model's, or bfloat16 for half the bytes

    @property
    def max_pages_per_seq(self) -> int:
        return -(-self.max_model_len // self.page_size)

    @property
    def token_buckets(self) -> tuple[int, ...]:
        """Padded step sizes: 1, then powers of two from 16 up to the token budget (which is always one)."""
        budget, size = self.max_num_batched_tokens, MIN_TOKEN_BUCKET
        buckets = {min(SINGLE_DECODE_BUCKET, budget), budget}
        while size < budget:
            buckets.add(size)
            size *= 2
        return tuple(sorted(buckets))

    def seq_bucket(self, token_bucket: int) -> int:
        """Sequence slots of a step with `token_bucket` tokens: every token could be its own sequence."""
        return min(token_bucket, self.max_num_seqs)


def default_kv_cache_memory() -> int:
    """Bytes for the KV pool: on CPU a quarter of RAM up to 4 GiB; on accelerators 85% of what is free."""
    device = jax.devices()[0]
    if device.platform == "cpu":
        total = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
        return min(4 * GiB, total // 4)
    stats = device.memory_stats() or {}
    free = stats.get("bytes_limit", 0) - stats.get("bytes_in_use", 0)
    return int(0.85 * free)


def resolve_engine_config(
    model: ModelConfig,
    dtype,
    *,
    max_model_len: int | None,
    max_num_seqs: int | None,
    max_num_batched_tokens: int | None,
    page_size: int,
    kv_cache_memory: int | None,
    seed: int,
    enable_prefix_caching: bool = True,
    schedule_policy: str = "fcfs",
    attention_backend: str = "auto",
    tensor_parallel_size: int = 1,
    async_scheduling: bool = True,
    kv_cache_dtype: str = "auto",
) -> EngineConfig:
    """`model` is the config as built (KV heads replicated for tensor parallelism); kv_cache_memory is
    per device, and each device holds 1/tensor_parallel_size of every page."""
    on_cpu = jax.default_backend() == "cpu"
    max_model_len = max_model_len or model.max_position_embeddings
    if max_model_len > model.max_position_embeddings:
        raise ValueError(f"max_model_len {max_model_len} exceeds the model's {model.max_position_embeddings} positions")
    max_num_seqs = max_num_seqs or (64 if on_cpu else 256)
    max_num_batched_tokens = max_num_batched_tokens or (512 if on_cpu else 2048)
    for name, value in (("page_size", page_size), ("max_num_seqs", max_num_seqs),
                        ("max_num_batched_tokens", max_num_batched_tokens)):  # fmt: skip
        if value < 1:
            raise ValueError(f"{name} must be >= 1, got {value}")
    kv_cache_dtype = jnp.dtype(dtype if kv_cache_dtype == "auto" else kv_cache_dtype).name
    page_bytes = page_size * kv_cache_bytes_per_token(model, kv_cache_dtype) // tensor_parallel_size
    memory = kv_cache_memory if kv_cache_memory is not None else default_kv_cache_memory()
    num_pages = memory // page_bytes
    if kv_cache_memory is None:  # never more than every sequence slot at full length could use
        num_pages = min(num_pages, max_num_seqs * -(-max_model_len // page_size))
    if num_pages * page_size < max_model_len:
        raise ValueError(
            f"KV cache of {memory / GiB:.2f} GiB holds {num_pages * page_size} tokens, fewer than max_model_len "
            f"{max_model_len}; raise kv_cache_memory or lower max_model_len"
        )
    if schedule_policy not in SCHEDULE_POLICIES:
        raise ValueError(f"schedule_policy must be one of {SCHEDULE_POLICIES}, got {schedule_policy!r}")
    return EngineConfig(max_model_len, max_num_seqs, max_num_batched_tokens, page_size, int(num_pages), seed,
                        enable_prefix_caching, schedule_policy, attention_backend, async_scheduling,
                        kv_cache_dtype)  # fmt: skip
