"""Load a model and its tokenizer from any supported source: the default model, GGUF, HF folder or Orbax."""

from __future__ import annotations

import dataclasses
import logging
import os
import time
from dataclasses import dataclass
from pathlib import Path

import jax
import jax.numpy as jnp
from flax import nnx
from jax.sharding import Mesh

from jserve import cpu_kernels
from jserve.config import ModelConfig
from jserve.loader.default_model import default_tokenizer
from jserve.loader.expert_tensors import stack_expert_tensors
from jserve.loader.fused_tensors import split_fused_tensors
from jserve.loader.gguf_source import gguf_config, iter_gguf_tensors, open_gguf
from jserve.loader.hf_config import read_hf_config
from jserve.loader.norm_offset import offset_norms
from jserve.loader.orbax_io import read_orbax, read_orbax_config, save_orbax
from jserve.loader.quantize import quantize_model
from jserve.loader.random_weights import random_params, shape_config
from jserve.loader.resolve import ModelSource, resolve_model
from jserve.loader.safetensors_source import count_tensors, iter_safetensors, safetensors_files
from jserve.loader.text_model import text_model_tensors
from jserve.loader.weights import assemble
from jserve.models.quantization import AUTO, QUANTIZATIONS, Quantization
from jserve.parallel import WeightPlacement
from jserve.tokenizer import Tokenizer

log = logging.getLogger("jserve")

DTYPES = {"float32": jnp.float32, "bfloat16": jnp.bfloat16}


@dataclass
class LoadedModel:
    config: ModelConfig
    graphdef: nnx.GraphDef
    params: nnx.State
    tokenizer: Tokenizer
    dtype: jnp.dtype
    source: ModelSource
    placement: WeightPlacement  # the checkpoint's config and the served one, and where each weight lives
    quantization: Quantization = Quantization.NONE  # int8, w8a8: projections, embedding and head hold int8 weights

    @property
    def mesh(self) -> Mesh | None:
        """Tensor parallelism: the devices the weights are split over (None: one device)."""
        return self.placement.mesh

    def save_orbax(self, folder: str | os.PathLike) -> None:
        if self.quantization is not Quantization.NONE:
            raise ValueError("`jserve convert` writes float weights; quantize when loading them instead")
        save_orbax(nnx.merge(self.graphdef, self.params), self.tokenizer, self.dtype, Path(folder))


def resolve_dtype(dtype: str) -> jnp.dtype:
    """'auto' is float32 on CPU (bfloat16 measured 5-10x slower on CPU XLA) and bfloat16 on accelerators."""
    if dtype == "auto":
        return jnp.dtype(jnp.float32 if jax.default_backend() == "cpu" else jnp.bfloat16)
    if dtype not in DTYPES:
        raise ValueError(f"unsupported dtype {dtype!r}; choose one of auto, {', '.join(DTYPES)}")
    return jnp.dtype(DTYPES[dtype])


def load_model(
    model: str | os.PathLike | ModelSource | None = None,
    dtype: str = "auto",
    mesh: Mesh | None = None,
    quantization: str = AUTO,
    revision: str | None = None,
    download_dir: str | os.PathLike | None = None,
    gguf_file: str | None = None,
    cpu_int8_kernel: bool = True,
    max_model_len: int | None = None,
    expert_parallel: bool = False,
    progress_bars: bool = True,
    head: bool = True,
) -> LoadedModel:
    """Load weights, config and tokenizer. `model`: None (the default model), a .gguf, an HF folder, a hub id
    (`org/name`, or `org/name:FILE.gguf`: from the HF cache, downloaded if absent), a `jserve convert` folder,
    `random:<shape>` (random weights, see MODEL_SHAPES), or the ModelSource resolve_model made of one.
    `revision`, `download_dir`, `gguf_file`: see resolve_model. `quantization`: "auto" (resolve_quantization),
    "gguf" (a GGUF file's blocks kept), "int8" or "w8a8": weights quantized once loaded
    (jserve.models.quantization), laid out for jserve's C++ kernel where it runs them unless `cpu_int8_kernel`
    is False. `max_model_len`: the context it will serve, which picks long-context rope frequencies where a
    model has two sets (longrope). `expert_parallel`: a mixture of experts on a mesh splits whole experts over
    its devices (not each expert). `progress_bars`: a tqdm bar while tensors load (off for a server, whose log
    gets the finished line only). `head`: False loads the model without its LM head (an embedder: hidden
    states only; a checkpoint's head tensor, if it has one, is skipped)."""
    if quantization not in QUANTIZATIONS:
        raise ValueError(f"unsupported quantization {quantization!r}; choose one of {', '.join(QUANTIZATIONS)}")
    target_dtype = resolve_dtype(dtype)
    if target_dtype == jnp.bfloat16 and jax.default_backend() == "cpu":
        log.warning(
            "--dtype bfloat16 on a CPU runs XLA's bfloat16 path, several times slower than float32 (SmolLM2 on 2 "
            "cores: 5 tok/s for one sequence against float32's 32). For speed leave --dtype out (auto: float32, "
            "or a GGUF file's own blocks); for less memory, --quantization int8 or w8a8"
        )
    if isinstance(model, ModelSource):
        source = model
    else:
        source = resolve_model(model, revision=revision, download_dir=download_dir, gguf_file=gguf_file)
    quantization = resolve_quantization(quantization, source, mesh, dtype)
    if quantization is Quantization.GGUF:
        check_gguf_blocks(source, mesh, target_dtype)
    start = time.perf_counter()
    if source.kind == "gguf":
        reader = open_gguf(source.path)
        config = served_shape(gguf_config(reader, source.path).for_context(max_model_len), head)
        tokenizer = Tokenizer.from_gguf(reader)
        tensors = iter_gguf_tensors(reader, config, source.path, keep_blocks=quantization is Quantization.GGUF)
        tensors = split_fused_tensors(stack_expert_tensors(tensors, config, source.path.name), config)
        placement = WeightPlacement.create(config, mesh, expert_parallel)
        total = len(reader.tensors)
        graphdef, params = assemble(placement, tensors, target_dtype, source.path.name, total, progress_bars)
    elif source.kind == "hf":
        config = served_shape(read_hf_config(source.path).for_context(max_model_len), head)
        tokenizer = Tokenizer.from_folder(source.path)
        files = safetensors_files(source.path)
        name = source.path.name
        placement = WeightPlacement.create(config, mesh, expert_parallel)
        graphdef, params = assemble(
            placement,
            offset_norms(
                split_fused_tensors(
                    stack_expert_tensors(text_model_tensors(iter_safetensors(files), name), config, name), config
                ),
                config,
            ),
            target_dtype,
            name,
            count_tensors(files),
            progress_bars,
        )
    elif source.kind == "random":
        config = served_shape(shape_config(source.path.name), head)
        tokenizer = default_tokenizer()
        placement = WeightPlacement.create(config, mesh, expert_parallel)
        graphdef, params = random_params(placement, target_dtype)
    else:
        config, saved_dtype = read_orbax_config(source.path)
        config = served_shape(config.for_context(max_model_len), head)
        tokenizer = Tokenizer.from_folder(source.path)
        tensors = read_orbax(source.path, config, saved_dtype)
        placement = WeightPlacement.create(config, mesh, expert_parallel)
        total = len(tensors)
        graphdef, params = assemble(placement, tensors.items(), target_dtype, source.path.name, total, progress_bars)
    num_params = sum(x.size for x in jax.tree.leaves(params))
    if quantization.quantized:
        graphdef, params = quantize_model(placement, params, target_dtype, quantization, cpu_int8_kernel)
    log.info(
        "Loaded %s model from %s (%s) in %.1fs: %d layers, %.0fM params, %s activations, %s weights (%.0f MB)",
        config.family, source.path, source.kind, time.perf_counter() - start, config.num_layers,
        num_params / 1e6, target_dtype.name,
        f"int8 ({quantization})" if quantization.quantized
        else "GGUF blocks" if quantization is Quantization.GGUF else target_dtype.name,
        sum(x.nbytes for x in jax.tree.leaves(params)) / 1e6,
    )  # fmt: skip
    return LoadedModel(placement.config, graphdef, params, tokenizer, target_dtype, source, placement, quantization)


def served_shape(config: ModelConfig, head: bool) -> ModelConfig:
    return config if head else dataclasses.replace(config, lm_head=False)


def resolve_quantization(quantization: str, source: ModelSource, mesh: Mesh | None, dtype: str) -> Quantization:
    """`auto`: a GGUF file keeps its blocks (gguf) on one CPU device whose kernel multiplies them with vector
    instructions (AVX-512 VNNI or AVX2), unless --dtype asks for a dtype (--dtype float32 is the exact,
    dequantized path); every other case, float checkpoints included, loads the weights as they are (none): a
    float checkpoint has no blocks to keep, and int8 / w8a8 change its numbers."""
    if quantization != AUTO:
        return Quantization(quantization)
    native = (
        source.kind == "gguf" and dtype == "auto" and mesh is None and jax.default_backend() == "cpu"
        and cpu_kernels.gguf_tiles_instructions() is not None
    )  # fmt: skip
    if native:
        log.info(
            "Quantization auto: the GGUF file's weights stay in their blocks, multiplied with %s (gguf; "
            "--dtype float32 for the dequantized float32 path)",
            cpu_kernels.gguf_tiles_instructions(),
        )
    return Quantization.GGUF if native else Quantization.NONE


def check_gguf_blocks(source: ModelSource, mesh: Mesh | None, dtype) -> None:
    """`--quantization gguf` keeps a GGUF file's blocks for jserve's C++ kernel: one CPU device, float32."""
    problem = (
        f"{source.path} is not a GGUF file" if source.kind != "gguf"
        else "it runs on one device (no tensor parallelism)" if mesh is not None
        else f"it runs on CPUs (this is {jax.default_backend()})" if jax.default_backend() != "cpu"
        else "its float32 activations need --dtype float32" if dtype != jnp.float32
        else "jserve's C++ kernels cannot be built here" if not cpu_kernels.available()
        else None
    )  # fmt: skip
    if problem:
        raise ValueError(f"--quantization gguf keeps a GGUF file's weights in their blocks, but {problem}")
