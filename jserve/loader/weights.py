"""Assemble a CausalLM from named checkpoint tensors: match names, check shapes, cast, place on device.

The module tree is built abstractly (no memory), then filled one tensor at a time, each converted
straight to its final dtype, so peak memory stays near one copy of the weights.
"""

from __future__ import annotations

from collections.abc import Iterable

import jax
import numpy as np
from flax import nnx
from tqdm.auto import tqdm

from jserve.config import ModelConfig
from jserve.errors import ModelLoadError
from jserve.models import CausalLM
from jserve.parallel import WeightPlacement


def param_name(path) -> str:
    """'layers.0.self_attn.q_proj.weight' for a state leaf path (the trailing `.value` attribute dropped)."""
    return ".".join(
        str(getattr(k, "key", getattr(k, "idx", None))) for k in path if not isinstance(k, jax.tree_util.GetAttrKey)
    )


def abstract_model(config: ModelConfig, dtype, quantization: str = "none") -> tuple[nnx.GraphDef, nnx.State]:
    return nnx.split(nnx.eval_shape(lambda: CausalLM(config, dtype=dtype, quantization=quantization)))


def expected_params(state: nnx.State) -> dict[str, jax.ShapeDtypeStruct]:
    return {param_name(path): leaf for path, leaf in jax.tree_util.tree_flatten_with_path(state)[0]}


def assemble(
    placement: WeightPlacement,
    tensors: Iterable[tuple[str, np.ndarray]],
    dtype,
    source: str,
    total: int | None = None,
) -> tuple[nnx.GraphDef, nnx.State]:
    """(graphdef, params) for the placement's config from (name, array) pairs checked against the
    checkpoint's config; names may carry the HF `model.` prefix."""
    config = placement.config
    graphdef, abstract = abstract_model(config, dtype)
    # Shapes as the checkpoint has them (tensor-parallel padding may have grown the placed ones).
    original = abstract if placement.original == config else abstract_model(placement.original, dtype)[1]
    expected = expected_params(original)
    loaded: dict[str, jax.Array] = {}
    for name, array in tqdm(tensors, total=total, desc=f"Loading {source}", unit="tensor", leave=False):
        key = name.removeprefix("model.")
        if key == "lm_head.weight" and config.tie_word_embeddings:
            continue  # tied: the embedding table is the head
        if key.endswith("rotary_emb.inv_freq"):
            continue  # recomputed from the config
        if key not in expected:
            raise ModelLoadError(f"{source}: unexpected tensor {name!r} for a {config.family} model")
        want = expected[key]
        if tuple(array.shape) != tuple(want.shape):
            raise ModelLoadError(
                f"{source}: tensor {name!r} has shape {tuple(array.shape)}, "
                f"expected {tuple(want.shape)} from the config"
            )
        loaded[key] = placement.put(key, np.asarray(array, dtype=want.dtype))
    missing = sorted(set(expected) - set(loaded))
    if missing:
        shown = ", ".join(missing[:5]) + (f" and {len(missing) - 5} more" if len(missing) > 5 else "")
        raise ModelLoadError(f"{source}: missing tensors {shown}")
    params = jax.tree_util.tree_map_with_path(lambda path, _: loaded[param_name(path)], abstract)
    return graphdef, params
