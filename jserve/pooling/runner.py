"""Runs an embedding model's steps: each scheduled chunk's tokens through the model, their K/V written to
the cache (a later chunk of the same input attends to them), and each chunk's pooling statistics back to
the host. One executable per token bucket, compiled at start-up, as for generation (engine/runner.py).
"""

from __future__ import annotations

import logging
import os
import time
from concurrent.futures import ThreadPoolExecutor

import jax
import numpy as np
from flax import nnx
from jax.sharding import NamedSharding, PartitionSpec

from jserve.attention import (
    AttentionBackend,
    KVCache,
    ModelInput,
    SequenceChunk,
    allocate_kv_cache,
    build_model_input,
    cache_writer_compiler_options,
    resolve_attention_backend,
)
from jserve.engine.config import EngineConfig
from jserve.engine.progress import progress
from jserve.engine.runner import COMPILE_WORKERS
from jserve.engine.scheduler import ScheduledSequence
from jserve.loader import LoadedModel
from jserve.parallel import kv_cache_spec
from jserve.pooling.statistics import chunk_statistics

log = logging.getLogger("jserve")


def pooling_step(
    graphdef: nnx.GraphDef,
    attention: AttentionBackend,
    params_def: jax.tree_util.PyTreeDef,
    kinds: tuple[str, ...],
    params: list[jax.Array],
    kv_cache: KVCache,
    batch: ModelInput,
) -> tuple[jax.Array, KVCache]:
    """-> (the statistics [S, len(kinds), hidden] of each sequence's chunk, the cache with its K/V written)."""
    model = nnx.merge(graphdef, jax.tree_util.tree_unflatten(params_def, params))
    hidden, kv_cache = model.hidden_states(batch, kv_cache, attention)
    states = model.norm(hidden)  # the final norm: the hidden states a base model outputs
    return chunk_statistics(states, batch.attention, kinds), kv_cache


class PoolingRunner:
    def __init__(self, model: LoadedModel, config: EngineConfig, kinds: tuple[str, ...]):
        self.model, self.config, self.kinds = model, config, kinds
        mesh = model.mesh
        kv_sharding = NamedSharding(mesh, kv_cache_spec()) if mesh else None
        self.input_sharding = NamedSharding(mesh, PartitionSpec()) if mesh else None
        self.kv_cache = allocate_kv_cache(
            model.config, config.num_pages, config.page_size, config.kv_cache_dtype, kv_sharding
        )
        self.attention = resolve_attention_backend(config.attention_backend, mesh=mesh)
        self.params, self.params_def = jax.tree_util.tree_flatten(model.params)
        shardings = (self.input_sharding, kv_sharding) if mesh else None
        self.step_fn = jax.jit(
            pooling_step,
            static_argnums=(0, 1, 2, 3),
            donate_argnums=(5,),
            out_shardings=shardings,
            compiler_options=cache_writer_compiler_options(jax.default_backend()),
        )
        self.executables: dict[int, jax.stages.Compiled] = {}
        self.prepare_s = 0.0  # host time building step inputs

    def warm_up(self, progress_bars: bool = False) -> None:
        """Compile every bucket (on worker threads: XLA compiles without the GIL) and run each once on an
        all-padding batch, which writes nothing."""
        start, buckets = time.perf_counter(), self.config.token_buckets
        workers = min(COMPILE_WORKERS, os.cpu_count() or 1)
        with (
            ThreadPoolExecutor(workers, thread_name_prefix="jserve-compile") as compiler,
            progress(len(buckets), "Compiling step buckets", "bucket", progress_bars) as bar,
        ):
            compiling = []
            for bucket in buckets:
                batch = self._placed(self._batch([], bucket))
                lowered = self.step_fn.lower(self.model.graphdef, self.attention, self.params_def, self.kinds,
                                             self.params, self.kv_cache, batch)  # fmt: skip
                compiling.append((bucket, batch, compiler.submit(lowered.compile)))
            for bucket, batch, compiled in compiling:
                self.executables[bucket] = compiled.result()
                stats, self.kv_cache = self.executables[bucket](self.params, self.kv_cache, batch)
                bar.update()
            jax.block_until_ready(stats)
        log.info("Compiled %d pooling step variants (token buckets %s) in %.1fs", len(buckets),
                 ", ".join(map(str, buckets)), time.perf_counter() - start)  # fmt: skip

    def run(self, sequences: list[ScheduledSequence]) -> np.ndarray:
        """Run one step of these chunks; returns their statistics, float32 [len(sequences), K, hidden]."""
        start = time.perf_counter()
        bucket = self.bucket_for(sum(s.num_tokens for s in sequences))
        batch = self._placed(self._batch(sequences, bucket))
        self.prepare_s += time.perf_counter() - start
        stats, self.kv_cache = self.executables[bucket](self.params, self.kv_cache, batch)
        return np.asarray(jax.device_get(stats))[: len(sequences)]

    def bucket_for(self, num_tokens: int) -> int:
        return next(b for b in self.config.token_buckets if b >= num_tokens)

    def _batch(self, sequences: list[ScheduledSequence], bucket: int) -> ModelInput:
        cfg = self.config
        chunks = [
            SequenceChunk(s.request.token_buffer[s.start : s.start + s.num_tokens], s.start, s.request.pages)
            for s in sequences
        ]
        return build_model_input(chunks, cfg.page_size, bucket, cfg.seq_bucket(bucket), cfg.max_pages_per_seq)

    def _placed(self, batch: ModelInput) -> ModelInput:
        """Replicated over a mesh, as the steps were compiled for; on one device the numpy arrays as they are."""
        return batch if self.input_sharding is None else jax.device_put(batch, self.input_sharding)
