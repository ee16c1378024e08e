"""EngineArgs: every setting an engine is built from, shared by `LLM`, the CLI and the server."""

from __future__ import annotations

import argparse
import logging
import os
import time
from dataclasses import dataclass, fields, replace

import jax

from jserve.attention import ATTENTION_BACKENDS
from jserve.engine.config import SCHEDULE_POLICIES, resolve_engine_config
from jserve.engine.engine import LLMEngine
from jserve.loader import load_model
from jserve.models.quantization import QUANTIZATIONS
from jserve.parallel import make_mesh
from jserve.parallel.distributed import agree_on_min
from jserve.paths import cache_dir

log = logging.getLogger("jserve")

DTYPES = ["auto", "float32", "bfloat16"]
KV_CACHE_DTYPES = ["auto", "float32", "bfloat16"]


def enable_compilation_cache() -> None:
    """Persist compiled steps across runs (unless the user chose a cache dir already)."""
    if not jax.config.jax_compilation_cache_dir and not os.environ.get("JAX_COMPILATION_CACHE_DIR"):
        jax.config.update("jax_compilation_cache_dir", str(cache_dir() / "xla"))


@dataclass(frozen=True)
class EngineArgs:
    model: str | os.PathLike | None = None  # None = the default model, SmolLM2-135M-Instruct
    revision: str | None = None  # of a hub model: a branch, tag or commit (None: main)
    download_dir: str | None = None  # where hub models are looked up and downloaded (None: the HF cache)
    gguf_file: str | None = None  # the one GGUF file to load from a hub repo or a local folder
    dtype: str = "auto"
    max_model_len: int | None = None
    max_num_seqs: int | None = None
    max_num_batched_tokens: int | None = None
    page_size: int = 16
    kv_cache_memory: int | None = None  # bytes
    enable_prefix_caching: bool = True
    schedule_policy: str = "fcfs"  # "lpm": longest cached prefix first; "priority": request priorities honoured
    tensor_parallel_size: int = 1
    seed: int = 0
    attention_backend: str = "auto"  # "reference" (plain JAX), "cpu" (C++) or "pallas"; auto picks per platform
    quantization: str = "none"  # "int8" / "w8a8": int8 weights, activations as two digits / in groups of 32
    async_scheduling: bool = True  # the host prepares step N+1 while the device runs step N
    kv_cache_dtype: str = "auto"  # the model's dtype; "bfloat16": half the KV bytes, K/V rounded to bfloat16

    def create_engine(self) -> LLMEngine:
        start = time.perf_counter()
        enable_compilation_cache()
        mesh = make_mesh(self.tensor_parallel_size)
        loaded = load_model(
            self.model,
            dtype=self.dtype,
            mesh=mesh,
            quantization=self.quantization,
            revision=self.revision,
            download_dir=self.download_dir,
            gguf_file=self.gguf_file,
        )
        config = resolve_engine_config(
            loaded.config,
            loaded.dtype,
            max_model_len=self.max_model_len,
            max_num_seqs=self.max_num_seqs,
            max_num_batched_tokens=self.max_num_batched_tokens,
            page_size=self.page_size,
            kv_cache_memory=self.kv_cache_memory,
            seed=self.seed,
            enable_prefix_caching=self.enable_prefix_caching,
            schedule_policy=self.schedule_policy,
            attention_backend=self.attention_backend,
            tensor_parallel_size=self.tensor_parallel_size,
            async_scheduling=self.async_scheduling,
            kv_cache_dtype=self.kv_cache_dtype,
        )
        # Hosts may differ in free memory; they must not differ in KV shapes.
        config = replace(config, num_pages=agree_on_min(config.num_pages))
        engine = LLMEngine(loaded, config)
        log.info("Engine ready in %.1fs", time.perf_counter() - start)
        return engine

    @staticmethod
    def add_cli_args(parser: argparse.ArgumentParser, model_flag: bool = True) -> None:
        """Engine flags, named as vLLM names them (`serve` takes the model as a positional argument)."""
        if model_flag:
            parser.add_argument("--model", default=None, help="GGUF file, HF folder, jserve folder, or hub id "
                                "(org/name or org/name:FILE.gguf, downloaded unless cached; default: "
                                "SmolLM2-135M-Instruct)")  # fmt: skip
        parser.add_argument("--revision", default=None, help="branch, tag or commit of a hub model (default: main)")
        parser.add_argument("--download-dir", default=None,
                            help="where hub models are looked up and downloaded (default: the Hugging Face cache, "
                            "HF_HUB_CACHE)")  # fmt: skip
        parser.add_argument("--gguf-file", default=None,
                            help="load this one GGUF file of a hub repo (or of a local folder of several)")  # fmt: skip
        parser.add_argument("--dtype", default="auto", choices=DTYPES, help="auto: float32 on CPU, bfloat16 elsewhere")
        parser.add_argument("--max-model-len", type=int, default=None, help="default: the model's context length")
        parser.add_argument("--max-num-seqs", type=int, default=None, help="sequences per step (CPU 64, else 256)")
        parser.add_argument("--max-num-batched-tokens", type=int, default=None,
                            help="token budget per step (CPU 512, else 2048)")  # fmt: skip
        parser.add_argument("--page-size", type=int, default=16, help="tokens per KV page")
        parser.add_argument("--kv-cache-memory", type=int, default=None, help="bytes for the KV cache")
        parser.add_argument("--enable-prefix-caching", action=argparse.BooleanOptionalAction, default=True,
                            help="share computed KV pages between requests with the same prefix")  # fmt: skip
        parser.add_argument("--schedule-policy", "--scheduling-policy", choices=SCHEDULE_POLICIES, default="fcfs",
                            help="admission order: fcfs (arrival), lpm (longest cached prefix first) or priority "
                            "(each request's priority, lower first, then arrival; other policies refuse a "
                            "priority other than 0)")  # fmt: skip
        parser.add_argument("--tensor-parallel-size", type=int, default=1,
                            help="devices to split each layer's heads and MLP over")  # fmt: skip
        parser.add_argument("--seed", type=int, default=0)
        parser.add_argument("--attention-backend", choices=ATTENTION_BACKENDS, default="auto",
                            help="auto: Pallas kernels on GPU/TPU, the C++ kernel on CPU (the plain-JAX "
                            "reference where no compiler can build it)")  # fmt: skip
        parser.add_argument("--quantization", choices=QUANTIZATIONS, default="none",
                            help="int8: int8 weights (per channel) times activations as two int8 digits per "
                            "token (as accurate as float activations); w8a8: one int8 digit with a scale per 32 "
                            "activations, about half the int8 work, less faithful to float32. Both read 4x fewer "
                            "weight bytes")  # fmt: skip
        parser.add_argument("--kv-cache-dtype", choices=KV_CACHE_DTYPES, default="auto",
                            help="auto: the model's dtype; bfloat16 halves the KV cache's bytes (more sequences "
                            "fit, attention reads less) and rounds K/V to bfloat16")  # fmt: skip
        parser.add_argument("--async-scheduling", action=argparse.BooleanOptionalAction, default=True,
                            help="schedule and prepare step N+1 while the device runs step N; outputs are "
                            "identical either way")  # fmt: skip

    @classmethod
    def from_cli_args(cls, args: argparse.Namespace) -> EngineArgs:
        return cls(**{f.name: getattr(args, f.name) for f in fields(cls)})
