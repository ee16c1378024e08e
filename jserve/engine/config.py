"""Engine settings, resolved once from the user's arguments, the model and the device."""

from __future__ import annotations

import logging
import os
from dataclasses import dataclass
from enum import StrEnum
from typing import Protocol

import jax
import jax.numpy as jnp

from jserve.attention import fit_attention_backend, kv_cache_bytes_per_token, reference
from jserve.config import ModelConfig
from jserve.spec_decode import SpeculativeConfig


class Settings(Protocol):
    """What resolving reads of the user's settings (EngineArgs, whose fields document them)."""

    max_model_len: int | None
    max_num_seqs: int | None
    max_num_batched_tokens: int | None
    page_size: int
    kv_cache_memory: int | None
    kv_cache_dtype: str
    attention_backend: str
    tensor_parallel_size: int
    speculative_config: dict | str | None
    schedule_policy: str
    seed: int
    enable_prefix_caching: bool
    async_scheduling: bool
    debug_checks: bool


log = logging.getLogger("jserve")

GiB = 1 << 30
MIN_TOKEN_BUCKET = 16
# One sequence decoding (a notebook, a chat) runs unpadded instead of padding to 16. On CPU a lone decode
# measured 12.7 ms a step at 1 token vs 14.5 at 2 with int8 weights, 27.3 vs 41.9 ms in float32
# (docs/benchmarks.md). Buckets 2, 4 and 8 would help a few concurrent decodes, but each bucket adds
# compile time to every start-up.
SINGLE_DECODE_BUCKET = 1
# On an accelerator the KV cache gets the free memory less the largest step's workspace (step_workspace_bytes)
# and this share of it, for what no formula sees: allocator fragmentation, cuBLAS/cuDNN workspaces, the
# compiled executables.
MEMORY_HEADROOM = 0.05
# [S, vocab] float32 arrays the sampler holds at once: the logits and the 8 its compiled memory_analysis
# counts on CPU (biased, penalised and scaled logits, noise, sort keys...), and 2 for a GPU sort's scratch.
SAMPLER_LOGITS_COPIES = 11


class SchedulePolicy(StrEnum):
    """The admission order of waiting requests."""

    FCFS = "fcfs"  # arrival
    LPM = "lpm"  # longest cached prefix first
    PRIORITY = "priority"  # each request's priority, then arrival: the only policy that honours a priority


SCHEDULE_POLICIES = tuple(p.value for p in SchedulePolicy)  # the flag's choices, as the user writes them


@dataclass(frozen=True)
class EngineConfig:
    """What the engine runs with: EngineArgs resolved against the model and the device. Defaults and their
    meaning live in EngineArgs; the scheduler and the runner read only this."""

    max_model_len: int
    max_num_seqs: int
    max_num_batched_tokens: int
    page_size: int
    num_pages: int
    seed: int
    enable_prefix_caching: bool
    schedule_policy: SchedulePolicy
    attention_backend: str  # fitted to the device; "auto" left to jserve.attention.resolve_attention_backend
    async_scheduling: bool
    kv_cache_dtype: str  # the pages' dtype: the model's, or bfloat16 for half the bytes
    speculative: SpeculativeConfig | None = None
    debug_checks: bool = False  # see EngineArgs.debug_checks

    @property
    def max_pages_per_seq(self) -> int:
        return -(-self.max_model_len // self.page_size)

    @property
    def token_buckets(self) -> tuple[int, ...]:
        """Padded step sizes: 1, then powers of two from 16 up to the token budget (which is always one); with
        speculation also one request's verify step (its token and its drafts), unpadded."""
        budget, size = self.max_num_batched_tokens, MIN_TOKEN_BUCKET
        buckets = {min(SINGLE_DECODE_BUCKET, budget), budget}
        if self.speculative is not None:
            buckets.add(min(self.speculative.num_speculative_tokens + 1, budget))
        while size < budget:
            buckets.add(size)
            size *= 2
        return tuple(sorted(buckets))

    def seq_bucket(self, token_bucket: int) -> int:
        """Sequence slots of a step with `token_bucket` tokens: every token could be its own sequence."""
        return min(token_bucket, self.max_num_seqs)

    def verify_rows(self, token_bucket: int) -> int:
        """Draft tokens a step of `token_bucket` tokens can verify: each needs a token of its own beside its
        request's last one, and at most disable_by_batch_size requests speculate at once (0: no speculation)."""
        spec = self.speculative
        if spec is None:
            return 0
        return min(token_bucket - 1, spec.disable_by_batch_size * spec.num_speculative_tokens)

    def proposing_rows(self, token_bucket: int) -> int:
        """Sequences of a step of `token_bucket` tokens that a device proposer (a draft model) proposes for
        (0: none)."""
        spec = self.speculative
        if spec is None or not spec.uses_draft_model:
            return 0
        return min(self.seq_bucket(token_bucket), spec.disable_by_batch_size)


@dataclass(frozen=True)
class DeviceLimits:
    """What one device offers the engine, read from it at start-up (tests pass their own)."""

    platform: str  # "cpu", "gpu" or "tpu"
    memory: int  # bytes: the host's RAM on CPU; elsewhere what the device's allocator has free
    smem_bytes: int = 0  # a TPU core's scalar memory (0 elsewhere)

    @staticmethod
    def of_default_device() -> DeviceLimits:
        device = jax.devices()[0]
        if device.platform == "cpu":
            return DeviceLimits("cpu", os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES"))
        free = free_device_memory(device.memory_stats() or {})
        if device.platform == "tpu":
            from pallas_kernels import tpu

            return DeviceLimits("tpu", free, tpu.smem_capacity())
        return DeviceLimits(device.platform, free)


def free_device_memory(stats: dict) -> int:
    """What an allocator's memory_stats() leave free for the KV cache: its two arrays hold every layer's pages
    (see KVPages), so where arrays freed during loading left holes, what the largest free block holds."""
    free = stats.get("bytes_limit", 0) - stats.get("bytes_in_use", 0)
    return min(free, stats.get("largest_free_block_bytes", free))


def step_workspace_bytes(model: ModelConfig, page_size: int, num_tokens: int, num_seqs: int, max_num_seqs: int) -> int:
    """An upper bound on the device memory a step of num_tokens tokens in num_seqs sequence slots needs besides
    the weights and the KV cache. Counted in float32 whatever the dtype, with its phases added although they
    run one after the other (slack for what an accelerator's compiler lays out differently):
    - one decoder layer's activations: the residual, its norm, the attention and MLP outputs (4 x hidden),
      q/k/v before and after RoPE and the attention output, gate/up and their product (3 x intermediate);
    - attention's work arrays, as the reference's (the Pallas kernels gather less);
    - the sampler's copies of the [num_seqs, vocab] logits;
    - per-sequence state allocated after the KV cache: the penalty state of max_num_seqs rows (bool + int32
      per token) and the step carry's held logits (float32 per token)."""
    qkv_heads = model.num_heads + 2 * model.num_kv_heads
    widths = 4 * model.hidden_size + (2 * qkv_heads + model.num_heads) * model.head_dim + 3 * model.intermediate_size
    attention = reference.workspace_bytes(num_tokens, num_seqs, heads=model.num_heads, kv_heads=model.num_kv_heads,
                                          head_dim=model.head_dim, page_size=page_size)  # fmt: skip
    logits = SAMPLER_LOGITS_COPIES * num_seqs * model.vocab_size
    return 4 * (num_tokens * widths + logits) + attention + 9 * max_num_seqs * model.vocab_size


def default_kv_cache_memory(limits: DeviceLimits, step_workspace: int) -> int:
    """Bytes for the KV pool: on CPU a quarter of RAM up to 4 GiB; on accelerators what is free once the
    largest step's workspace and MEMORY_HEADROOM are set aside, so that warm-up cannot run out."""
    if limits.platform == "cpu":
        return min(4 * GiB, limits.memory // 4)
    return max(0, int((1 - MEMORY_HEADROOM) * limits.memory) - step_workspace)


def resolve_engine_config(
    args: Settings, model: ModelConfig, dtype, limits: DeviceLimits | None = None, draft: ModelConfig | None = None
) -> EngineConfig:
    """`model` is the config as built (KV heads replicated for tensor parallelism), `dtype` the weights'.
    kv_cache_memory is per device, and each device holds 1/tensor_parallel_size of every page. `limits`: the
    device's (default: read from the default device). `draft`: a draft model's config, whose K/V every page
    holds too."""
    limits = limits or DeviceLimits.of_default_device()
    on_cpu = limits.platform == "cpu"
    page_size, kv_cache_memory = args.page_size, args.kv_cache_memory
    max_model_len = args.max_model_len or model.max_position_embeddings
    if max_model_len > model.max_position_embeddings:
        raise ValueError(f"max_model_len {max_model_len} exceeds the model's {model.max_position_embeddings} positions")
    max_num_seqs = args.max_num_seqs or (64 if on_cpu else 256)
    max_num_batched_tokens = args.max_num_batched_tokens or (512 if on_cpu else 2048)
    for name, value in (("page_size", page_size), ("max_num_seqs", max_num_seqs),
                        ("max_num_batched_tokens", max_num_batched_tokens)):  # fmt: skip
        if value < 1:
            raise ValueError(f"{name} must be >= 1, got {value}")
    kv_cache_dtype = jnp.dtype(dtype if args.kv_cache_dtype == "auto" else args.kv_cache_dtype).name
    attention_backend = fit_attention_backend(
        args.attention_backend, limits.platform, head_dim=model.head_dim, page_size=page_size,
        kv_cache_dtype=kv_cache_dtype, max_model_len=max_model_len, num_tokens=max_num_batched_tokens,
        max_num_seqs=max_num_seqs, smem_bytes=limits.smem_bytes,
    )  # fmt: skip
    token_bytes = sum(kv_cache_bytes_per_token(m, kv_cache_dtype) for m in (model, draft) if m is not None)
    page_bytes = page_size * token_bytes // args.tensor_parallel_size
    speculative = SpeculativeConfig.parse(args.speculative_config)
    # The sampler's rows: the step's sequences, and its verify rows with speculation.
    verify_rows = speculative.disable_by_batch_size * speculative.num_speculative_tokens if speculative else 0
    largest_step = (max_num_batched_tokens, min(max_num_batched_tokens, max_num_seqs) + verify_rows)
    workspace = max(step_workspace_bytes(m, page_size, *largest_step, max_num_seqs) for m in (model, draft) if m)
    fits = default_kv_cache_memory(limits, workspace)
    memory = kv_cache_memory if kv_cache_memory is not None else fits
    if not on_cpu and memory > fits:
        log.warning("kv_cache_memory of %.2f GiB leaves the largest step less than the %.2f GiB it may need: "
                    "warm-up may run out of memory", memory / GiB, workspace / GiB)  # fmt: skip
    num_pages = memory // page_bytes
    if kv_cache_memory is None:  # never more than every sequence slot at full length could use
        num_pages = min(num_pages, max_num_seqs * -(-max_model_len // page_size))
    if num_pages * page_size < max_model_len:
        set_aside = "" if on_cpu or kv_cache_memory is not None else (
            f" ({workspace / GiB:.2f} GiB of the free {limits.memory / GiB:.2f} GiB set aside for the step of "
            f"max_num_batched_tokens {max_num_batched_tokens} and max_num_seqs {max_num_seqs})"
        )  # fmt: skip
        raise ValueError(
            f"KV cache of {memory / GiB:.2f} GiB{set_aside} holds {num_pages * page_size} tokens, fewer than "
            f"max_model_len {max_model_len}; raise kv_cache_memory or lower max_model_len"
        )
    if args.schedule_policy not in SCHEDULE_POLICIES:
        raise ValueError(f"schedule_policy must be one of {SCHEDULE_POLICIES}, got {args.schedule_policy!r}")
    return EngineConfig(
        max_model_len=max_model_len,
        max_num_seqs=max_num_seqs,
        max_num_batched_tokens=max_num_batched_tokens,
        page_size=page_size,
        num_pages=int(num_pages),
        seed=args.seed,
        enable_prefix_caching=args.enable_prefix_caching,
        schedule_policy=SchedulePolicy(args.schedule_policy),
        attention_backend=attention_backend,
        async_scheduling=args.async_scheduling,
        kv_cache_dtype=kv_cache_dtype,
        speculative=speculative,
        debug_checks=args.debug_checks,
    )
