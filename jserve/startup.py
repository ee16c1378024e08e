"""Build the engine EngineArgs describe: find the model, decide what it serves (text, or one vector per input
for an embedding model), load it, size the KV cache and compile the steps."""

from __future__ import annotations

import logging
import os
import time
from dataclasses import replace

import jax

from jserve.engine.args import EngineArgs
from jserve.engine.config import resolve_engine_config
from jserve.engine.engine import LLMEngine
from jserve.loader import LoadedModel, load_model
from jserve.loader.resolve import ModelSource, resolve_model
from jserve.parallel import make_mesh
from jserve.parallel.distributed import agree_on_min, is_multi_process
from jserve.paths import cache_dir
from jserve.pooling import DECODER_DEFAULT, EmbeddingEngine, PoolingConfig, parse_pooler_config, read_pooling_config
from jserve.spec_decode import SpeculativeConfig, check_draft_model

log = logging.getLogger("jserve")


def create_engine(args: EngineArgs, progress_bars: bool = False) -> LLMEngine | EmbeddingEngine:
    """`progress_bars`: start-up work as tqdm bars (notebooks, the CLI) rather than log lines (a server)."""
    start = time.perf_counter()
    enable_compilation_cache()
    parse_pooler_config(args.pooler_config)  # a bad one fails before anything loads
    source = resolve_model(args.model, revision=args.revision, download_dir=args.download_dir, gguf_file=args.gguf_file)
    pooling = embedding_pooling(args, source)
    if pooling is None:
        engine = _generation_engine(args, source, progress_bars)
    else:
        engine = _embedding_engine(args, source, pooling, progress_bars)
    log.info("Engine ready in %.1fs", time.perf_counter() - start)
    return engine


def enable_compilation_cache() -> None:
    """Persist compiled steps across runs (unless the user chose a cache dir already)."""
    if not jax.config.jax_compilation_cache_dir and not os.environ.get("JAX_COMPILATION_CACHE_DIR"):
        jax.config.update("jax_compilation_cache_dir", str(cache_dir() / "xla"))


def embedding_pooling(args: EngineArgs, source: ModelSource) -> PoolingConfig | None:
    """How the model pools, if it is to embed (None: it generates). task auto embeds where a checkpoint's
    sentence-transformers files say how to pool; task embed also for any other model, pooling its last
    token's state, normalized; --pooler-config overrides either."""
    if args.task == "generate":
        if args.pooler_config is not None:
            raise ValueError("--pooler-config is for embedding models; this engine generates (--task generate)")
        return None
    found = read_pooling_config(source.path) if source.kind == "hf" else None
    if found is None and args.task == "auto":
        if args.pooler_config is not None:
            raise ValueError(f"{source.path} has no sentence-transformers pooling files: with --pooler-config, "
                             "say --task embed to serve it as an embedding model")  # fmt: skip
        return None
    return (found or DECODER_DEFAULT).overridden(args.pooler_config)


def _generation_engine(args: EngineArgs, source: ModelSource, progress_bars: bool) -> LLMEngine:
    mesh = make_mesh(args.tensor_parallel_size)
    loaded = load_model(
        source,
        dtype=args.dtype,
        mesh=mesh,
        quantization=args.quantization,
        cpu_int8_kernel=args.cpu_int8_kernel,
        max_model_len=args.max_model_len,
        expert_parallel=args.enable_expert_parallel,
        progress_bars=progress_bars,
    )
    draft = _load_draft_model(args, loaded, mesh, progress_bars)
    config = resolve_engine_config(args, loaded.config, loaded.dtype, draft=draft.config if draft else None)
    # Hosts may differ in free memory; they must not differ in KV shapes.
    config = replace(config, num_pages=agree_on_min(config.num_pages))
    engine = LLMEngine(loaded, config, draft, progress_bars, args.lora_config)
    for name, path in args.named_lora_modules.items():
        engine.adapters.register(name, path)
    return engine


def _load_draft_model(args: EngineArgs, target: LoadedModel, mesh, progress_bars: bool) -> LoadedModel | None:
    """The draft model of draft-model speculation, loaded like the target (dtype, devices; quantization as
    the config says, else the target's), and checked to share its tokenizer."""
    spec = SpeculativeConfig.parse(args.speculative_config)
    if spec is None or not spec.uses_draft_model:
        return None
    draft = load_model(spec.model, dtype=args.dtype, mesh=mesh, quantization=spec.quantization or args.quantization,
                       cpu_int8_kernel=args.cpu_int8_kernel, download_dir=args.download_dir,
                       max_model_len=args.max_model_len, progress_bars=progress_bars)  # fmt: skip
    check_draft_model(target, draft)
    return draft


def _embedding_engine(
    args: EngineArgs, source: ModelSource, pooling: PoolingConfig, progress_bars: bool
) -> EmbeddingEngine:
    """The model without its head. Inputs may be as long as sentence-transformers' max_seq_length unless
    max_model_len says otherwise; pooling that reads every token's state turns the prefix cache off (a cached
    prefix's tokens are not computed again)."""
    if args.speculative_config is not None:
        raise ValueError("speculative decoding speeds up generation; an embedding model does not decode")
    if args.enable_lora:
        raise ValueError("LoRA adapters are served for generation; this engine embeds (--task embed)")
    if is_multi_process():
        raise ValueError("an embedding model is served from one host")
    max_model_len = args.max_model_len
    if max_model_len is None and pooling.max_seq_length:
        max_model_len = pooling.max_seq_length + 1  # (max_model_len counts one token past the longest input)
    loaded = load_model(
        source,
        dtype=args.dtype,
        mesh=make_mesh(args.tensor_parallel_size),
        quantization=args.quantization,
        cpu_int8_kernel=args.cpu_int8_kernel,
        max_model_len=max_model_len,
        expert_parallel=args.enable_expert_parallel,
        progress_bars=progress_bars,
        head=False,
    )
    if max_model_len is not None:
        max_model_len = min(max_model_len, loaded.config.max_position_embeddings)
    caching = args.enable_prefix_caching and not pooling.reads_every_token
    if args.enable_prefix_caching and not caching:
        log.info("Prefix caching off: %s pooling reads every input token's hidden state", "+".join(pooling.modes))
    settings = replace(args, max_model_len=max_model_len, enable_prefix_caching=caching)
    config = resolve_engine_config(settings, loaded.config, loaded.dtype)
    return EmbeddingEngine(loaded, config, pooling, progress_bars)
