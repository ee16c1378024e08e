"""Quantize a loaded model's weights to int8 where they already are (on their devices, in their shards).

Done after loading, so every source (GGUF, safetensors, Orbax, random) goes through the same few lines.
"""

from __future__ import annotations

from functools import cache

import jax
from flax import nnx

from jserve.loader.weights import abstract_model, leaves_by_name, param_name
from jserve.models.quantization import Quantization, quantize_rows, tile, tiles_weights
from jserve.parallel import WeightPlacement


def quantize_model(
    placement: WeightPlacement, params: nnx.State, dtype, quantization: Quantization, cpu_kernel: bool = True
) -> tuple[nnx.GraphDef, nnx.State]:
    """(graphdef, params) of the int8 or w8a8 model: each int8 weight and its `weight_scale` from the float
    weight, the weight in the CPU kernel's tiles where it will run them (never if not `cpu_kernel`; never for
    experts, which run as grouped matmuls through XLA's int8 dot: grouped_matmul.py)."""
    graphdef, abstract = abstract_model(placement.config, dtype, quantization, placement.parallelism)
    tiled = tiles_weights(cpu_kernel)
    floats = leaves_by_name(params)
    done: dict[str, jax.Array] = {}
    for name, leaf in leaves_by_name(abstract).items():
        if leaf.dtype == "int8":
            scale = name + "_scale"
            quantize = quantizer(placement.sharding(name), placement.sharding(scale), tiled)
            done[name], done[scale] = quantize(floats[name])
        elif name not in done:
            done[name] = floats[name]
    return graphdef, jax.tree_util.tree_map_with_path(lambda path, _: done[param_name(path)], abstract)


@cache
def quantizer(weight_sharding, scale_sharding, tiled: bool):
    """A float weight -> (int8 weight, scale per output row), sharded so; in the CPU kernel's tiles if `tiled`."""

    def quantize(w):
        q, scale = quantize_rows(w)
        return (tile(q) if tiled and q.ndim == 2 else q), scale  # experts' stacked weights stay in rows

    return jax.jit(quantize, out_shardings=None if weight_sharding is None else (weight_sharding, scale_sharding))
