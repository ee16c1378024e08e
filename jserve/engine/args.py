"""EngineArgs: every setting an engine is built from, declared once for `LLM`, the CLI, config files and the
server."""

from __future__ import annotations

import argparse
import os
from dataclasses import dataclass

from jserve.attention import ATTENTION_BACKENDS
from jserve.engine.config import SCHEDULE_POLICIES
from jserve.loader import DTYPES as FLOAT_DTYPES
from jserve.lora import LoRAConfig, parse_lora_modules
from jserve.models.quantization import QUANTIZATIONS
from jserve.setting import add_flags, from_namespace, setting
from jserve.spec_decode import SpeculativeConfig

TASKS = ["auto", "generate", "embed"]
DTYPES = ["auto", *FLOAT_DTYPES]  # auto: float32 on CPU, bfloat16 elsewhere (resolve_dtype)
KV_CACHE_DTYPES = ["auto", *FLOAT_DTYPES]  # auto: the model's dtype
# Sets debug_checks' default for a whole process and the servers it starts (a test suite).
DEBUG_CHECKS_ENV = "JSERVE_DEBUG_CHECKS"


@dataclass(frozen=True)
class EngineArgs:
    """Every engine setting, declared once: `LLM(...)` takes them as keywords, the commands as flags (the
    field's name with dashes) and config files as keys; each one's help is its documentation."""

    model: str | os.PathLike | None = setting(
        None,
        "GGUF file, HF folder, jserve folder, or hub id (org/name or org/name:FILE.gguf, downloaded unless "
        "cached; default: SmolLM2-135M-Instruct)",
    )
    revision: str | None = setting(None, "branch, tag or commit of a hub model (default: main)")
    download_dir: str | None = setting(
        None, "where hub models are looked up and downloaded (default: the Hugging Face cache, HF_HUB_CACHE)"
    )
    gguf_file: str | None = setting(None, "load this one GGUF file of a hub repo (or of a local folder of several)")
    dtype: str = setting("auto", "auto: float32 on CPU, bfloat16 elsewhere", choices=DTYPES)
    max_model_len: int | None = setting(None, "default: the model's context length")
    max_num_seqs: int | None = setting(None, "sequences per step (CPU 64, else 256)")
    max_num_batched_tokens: int | None = setting(None, "token budget per step (CPU 512, else 2048)")
    page_size: int = setting(16, "tokens per KV page")
    kv_cache_memory: int | None = setting(None, "bytes for the KV cache")
    enable_prefix_caching: bool = setting(True, "share computed KV pages between requests with the same prefix")
    schedule_policy: str = setting(
        "fcfs",
        "admission order: fcfs (arrival), lpm (longest cached prefix first) or priority (each request's "
        "priority, lower first, then arrival; other policies refuse a priority other than 0)",
        choices=SCHEDULE_POLICIES,
        aliases=("--scheduling-policy",),
    )
    tensor_parallel_size: int = setting(1, "devices to split each layer's heads and MLP over")
    enable_expert_parallel: bool = setting(
        False,
        "mixture-of-experts models: split whole experts over the tensor-parallel devices (each holds and runs "
        "num_experts / tensor_parallel_size of them) instead of splitting every expert",
    )
    seed: int = setting(0, "seeds the sampling of requests that bring no seed of their own")
    attention_backend: str = setting(
        "auto",
        "auto: Pallas kernels on GPU/TPU, the C++ kernel on CPU (the plain-JAX reference where no compiler can "
        "build it)",
        choices=ATTENTION_BACKENDS,
    )
    quantization: str = setting(
        "auto",
        "auto: gguf for a GGUF file on one CPU with AVX2 or AVX-512 VNNI and --dtype auto, else none; gguf: the file's "
        "Q4/Q5/Q8/K-quant weights kept in their blocks, float32 activations (logits within 1e-3 of float32); "
        "none: weights as loaded (a GGUF file dequantized); int8: int8 weights (per channel) times activations "
        "as two int8 digits per token; w8a8: one int8 digit with a scale per 32 activations, about half the "
        "int8 work, less faithful to float32. int8 and w8a8 read 4x fewer weight bytes than float32",
        choices=QUANTIZATIONS,
    )
    cpu_int8_kernel: bool = setting(
        True,
        "int8 and w8a8 on one CPU with AVX-512 VNNI: run the projections in jserve's C++ kernel, 2-5x faster than "
        "XLA's quantize-and-int8-dot ops (which --no-cpu-int8-kernel runs instead, for comparison)",
    )
    kv_cache_dtype: str = setting(
        "auto",
        "auto: the model's dtype; bfloat16 halves the KV cache's bytes (more sequences fit, attention reads "
        "less) and rounds K/V to bfloat16",
        choices=KV_CACHE_DTYPES,
    )
    async_scheduling: bool = setting(
        True, "schedule and prepare step N+1 while the device runs step N; outputs are identical either way"
    )
    speculative_config: dict | str | None = setting(
        None,
        'speculative decoding, as vLLM\'s JSON: {"method": "ngram", "num_speculative_tokens": 4, '
        '"prompt_lookup_max": 4, "prompt_lookup_min": 2} proposes what followed the latest earlier occurrence of '
        "the last n tokens; the target model verifies the drafts in one step (greedy output is unchanged). "
        '"disable_by_batch_size" (default 4): speculate only while at most this many requests run',
    )

    task: str = setting(
        "auto",
        "generate (text), or embed (one vector per input: LLM.embed, /v1/embeddings); auto: embed for a checkpoint "
        "whose sentence-transformers files (modules.json) say how to pool, else generate",
        choices=TASKS,
    )
    pooler_config: dict | str | None = setting(
        None,
        'an embedding model\'s pooling, as vLLM\'s JSON: {"pooling_type": "MEAN", "normalize": false}; '
        "pooling_type LAST, MEAN, CLS, MAX or a sentence-transformers mode name. Default: the checkpoint's "
        "sentence-transformers files, else LAST, normalized",
        aliases=("--override-pooler-config",),
    )

    enable_lora: bool = setting(
        False, "serve LoRA adapters (PEFT folders) of this model: --lora-modules, LoRARequest, the request's model"
    )
    lora_modules: list[str] | None = setting(
        None,
        "adapters to serve, each as name=path (a PEFT folder or hub id) or vLLM's JSON "
        '{"name": ..., "path": ...}; a request names one as its model',
    )
    max_loras: int = setting(1, "adapters on the device at once; a batch mixes the base and up to this many")
    max_lora_rank: int = setting(16, "the largest adapter rank served (every slot is this rank)")
    max_cpu_loras: int | None = setting(
        None, "adapters requests bring (LoRARequest paths) kept in host memory (default: max_loras)"
    )

    debug_checks: bool = setting(
        os.environ.get(DEBUG_CHECKS_ENV) == "1",
        "fail on any compilation after warm-up, and whenever the engine goes idle check that every sequence "
        "slot and KV page came back and the prefix cache keeps its invariants (a walk of the whole cache, up to "
        "~165 ms on a full one: for tests, not serving), and build each decode step continued from the one before "
        f"afresh too, to compare. Default: on where {DEBUG_CHECKS_ENV}=1",
    )

    def __post_init__(self):
        SpeculativeConfig.parse(self.speculative_config)  # a bad config fails now, before the model loads
        _ = self.lora_config, self.named_lora_modules  # (likewise)

    @property
    def lora_config(self) -> LoRAConfig | None:
        """The adapter settings, None without --enable-lora (where --lora-modules is an error)."""
        if not self.enable_lora:
            if self.lora_modules:
                raise ValueError("--lora-modules needs --enable-lora")
            return None
        return LoRAConfig(self.max_loras, self.max_lora_rank, self.max_cpu_loras, self.download_dir)

    @property
    def named_lora_modules(self) -> dict[str, str]:
        """--lora-modules as {name: path}."""
        return parse_lora_modules(self.lora_modules or [])

    @classmethod
    def add_cli_args(cls, parser: argparse.ArgumentParser, positional_model: bool = False) -> None:
        """A flag per setting, named as vLLM names them; `serve` takes the model as a positional argument."""
        add_flags(parser, cls, positional=["model"] if positional_model else [])

    @classmethod
    def from_cli_args(cls, args: argparse.Namespace) -> EngineArgs:
        return from_namespace(cls, args)
