"""New weights for a loaded model, in the engine's own layout, from what a trainer hands over.

`names="hf"`: checkpoint tensor names, as safetensors files and transformers' `state_dict()` have them. They
go through the loaders' steps (a multimodal checkpoint's text model renamed, experts stacked, fused
checkpoint projections split, Gemma's norms offset, KV heads replicated for tensor parallelism), and the
pieces of each fused projection are fused again; a piece not given keeps its current rows. `names="jserve"`:
the engine's parameters as they are (`get_weights(names="jserve")`), fused, stacked, quantized and sharded.

An array already on the engine's devices with the parameter's sharding, dtype and shape is used as it is (no
copy); any other is cast and placed with the parameter's sharding, and a float weight for an int8 parameter is
quantized as loading quantizes it. Every given tensor is checked before anything changes: one that names no
parameter, or has another shape, is a WeightUpdateError naming it as it was given.
"""

from __future__ import annotations

import os
from collections.abc import Iterable, Iterator, Mapping
from pathlib import Path
from typing import TYPE_CHECKING, Any

import jax
import numpy as np
from flax import nnx

from jserve.errors import ModelLoadError, WeightUpdateError
from jserve.loader.expert_tensors import stack_expert_tensors
from jserve.loader.fused_tensors import split_fused_tensors
from jserve.loader.norm_offset import offset_norms
from jserve.loader.orbax_io import read_orbax, read_orbax_config
from jserve.loader.quantize import quantizer
from jserve.loader.resolve import resolve_model
from jserve.loader.safetensors_source import iter_safetensors, safetensors_files
from jserve.loader.text_model import TEXT_PREFIXES, text_model_tensors
from jserve.loader.weights import abstract_module, checkpoint_tensors, fused_pieces, leaves_by_name, param_name
from jserve.models.fused import fuse
from jserve.models.fused import split as fused_split
from jserve.models.quantization import Quantization, is_tiled
from jserve.parallel import replicate_kv_heads

if TYPE_CHECKING:
    from jserve.loader import LoadedModel

NAMES = ("hf", "jserve")
Weights = Any  # nnx.Module | nnx.State | Mapping[str, array] | str | os.PathLike


def updated_params(model: LoadedModel, weights: Weights, names: str = "hf") -> nnx.State:
    """The model's params with `weights` in place of theirs. Nothing of the model changes here: the caller
    swaps the params in (until then the new arrays take device memory beside the old ones)."""
    if names not in NAMES:
        raise WeightUpdateError(f"names must be one of {', '.join(NAMES)}; got {names!r}")
    if model.quantization is Quantization.GGUF:
        raise WeightUpdateError(
            "this engine multiplies the GGUF file's blocks, which new weights cannot become: load the model "
            "with --dtype float32 (or --quantization int8) to update its weights"
        )
    current = leaves_by_name(model.params)
    module = abstract_module(model.config, model.dtype, parallelism=model.placement.parallelism)
    if isinstance(weights, (str, os.PathLike)):
        given = _engine_layout(model, module, current, _checkpoint_file_tensors(Path(weights)))
    elif isinstance(weights, (nnx.Module, nnx.State)):
        state = nnx.state(weights) if isinstance(weights, nnx.Module) else weights
        given = {name: (name, array) for name, array in leaves_by_name(state).items()}
    elif isinstance(weights, Mapping):
        if names == "jserve":
            given = {name: (name, array) for name, array in leaves_by_name(dict(weights)).items()}
        else:
            given = _engine_layout(model, module, current, weights.items())
    else:
        raise WeightUpdateError(
            f"weights must be a Flax NNX model or State, a mapping of names to arrays, or a checkpoint path; "
            f"got {type(weights).__name__}"
        )
    if not given:
        raise WeightUpdateError("no weights given")
    floats = _float_shapes(model, module)
    new = dict(current)
    for name, (label, array) in given.items():
        if name not in current:
            raise WeightUpdateError(f"tensor {label!r} names no parameter of this {model.config.family} model")
        new.update(_conformed(label, array, name, current[name], floats.get(name), model))
    if missing := [name for name, leaf in new.items() if isinstance(leaf, jax.ShapeDtypeStruct)]:
        shown = ", ".join(missing[:5]) + (f" and {len(missing) - 5} more" if len(missing) > 5 else "")
        raise WeightUpdateError(f"the engine's weights were dropped (sleep level 2): give every one; missing {shown}")
    return jax.tree_util.tree_map_with_path(lambda path, _: new[param_name(path)], model.params)


def _conformed(label: str, array, name: str, leaf: jax.Array, float_shape, model: LoadedModel) -> dict:
    """{parameter: array} for `array` given as parameter `name` (now `leaf`): the array as it is when the
    engine holds it so already, else cast and placed like `leaf`; a float weight for an int8 `leaf` quantized
    (with its scale)."""
    shape = tuple(np.shape(array))
    if leaf.dtype == np.int8 and shape == float_shape and _is_float(array):
        placement = model.placement
        quantize = quantizer(placement.sharding(name), placement.sharding(name + "_scale"), is_tiled(leaf))
        floats = array if isinstance(array, jax.Array) else np.asarray(array, np.float32)
        q, scale = quantize(jax.device_put(floats, placement.sharding(name)))
        return {name: q, name + "_scale": scale}
    if shape != leaf.shape:
        raise WeightUpdateError(f"tensor {label!r} has shape {shape}; the model's {name!r} is {leaf.shape}")
    if isinstance(array, jax.Array):
        if array.dtype != leaf.dtype:
            array = array.astype(leaf.dtype)
        return {name: jax.device_put(array, leaf.sharding)}  # (the array itself when already placed so)
    # A copy of our own: on a CPU, device_put may keep a host array's buffer as the device's, and a trainer
    # that changed its array in place would change the served weights with it.
    return {name: jax.device_put(np.asarray(array).astype(leaf.dtype, copy=True), leaf.sharding)}


def _is_float(array) -> bool:
    dtype = getattr(array, "dtype", None)
    return dtype is None or "float" in str(dtype)


def _float_shapes(model: LoadedModel, module) -> dict[str, tuple[int, ...]]:
    """Each parameter's shape as a float weight (of an int8 parameter: before quantizing), from the model's
    abstract float module."""
    if not model.quantization.quantized:
        return {}
    return {name: tuple(leaf.shape) for name, leaf in leaves_by_name(nnx.state(module)).items()}


def _checkpoint_file_tensors(path: Path) -> Iterable[tuple[str, np.ndarray]]:
    """A Hugging Face folder's or a `jserve convert` folder's tensors, by checkpoint name."""
    try:
        source = resolve_model(path)
    except (ModelLoadError, OSError) as error:
        raise WeightUpdateError(f"cannot read weights from {path}: {error}") from None
    if source.kind == "hf":
        return iter_safetensors(safetensors_files(source.path))
    if source.kind == "orbax":
        return read_orbax(source.path, *read_orbax_config(source.path)).items()
    raise WeightUpdateError(f"{path}: updates read safetensors or `jserve convert` folders, not {source.kind} files")


def _engine_layout(
    model: LoadedModel, module, current: dict[str, jax.Array], tensors: Iterable[tuple[str, Any]]
) -> dict[str, tuple[str, Any]]:
    """{parameter: (the name it was given as, its array)} from checkpoint-named tensors, pieces fused
    (`module`: the model's abstract float module)."""
    placement, config = model.placement, model.config
    original = placement.original
    pieces = fused_pieces(module)
    expected = checkpoint_tensors(
        module if original == config else abstract_module(original, model.dtype, parallelism=placement.parallelism)
    )
    labels: dict[str, str] = {}  # checkpoint name -> the name it was given as, where one gave one
    given: dict[str, tuple[str, Any]] = {}
    parts: dict[str, list] = {}  # fused parameter -> its pieces so far
    for key, array in _checkpoint_steps(tensors, model, labels):
        label = labels.get(key, key)
        if key.endswith("rotary_emb.inv_freq") or (key == "lm_head.weight" and config.tie_word_embeddings):
            continue  # recomputed from the config; a tied head is the embedding
        if key not in expected:
            raise WeightUpdateError(f"tensor {label!r} names no parameter of this {config.family} model")
        want = tuple(expected[key].shape)
        if tuple(np.shape(array)) != want:
            raise WeightUpdateError(f"tensor {label!r} has shape {tuple(np.shape(array))}; the model's is {want}")
        if key not in pieces:
            given[key] = (label, array)
            continue
        piece = pieces[key]
        slots = parts.setdefault(piece.param, [None] * len(piece.widths))
        slots[piece.index] = (label, replicate_kv_heads(key, np.asarray(array), original, config))
    for param, slots in parts.items():
        piece_of = next(p for p in pieces.values() if p.param == param)
        if any(slot is None for slot in slots):
            if isinstance(current[param], jax.ShapeDtypeStruct):
                continue  # no current rows to keep (sleep level 2): reported missing with the rest
            if current[param].dtype == np.int8:
                missing = [key for key, p in pieces.items() if p.param == param and slots[p.index] is None]
                raise WeightUpdateError(
                    f"an int8 model quantizes {param!r} as one weight: give {', '.join(map(repr, missing))} too"
                )
            old = fused_split(np.asarray(current[param]), piece_of.widths, piece_of.shards, piece_of.axis)
            slots = [slot if slot is not None else (None, old[i]) for i, slot in enumerate(slots)]
        labels_given = [label for label, _ in slots if label is not None]
        arrays = [np.asarray(array, dtype=np.float32) for _, array in slots]
        given[param] = (" + ".join(labels_given), fuse(arrays, piece_of.shards, piece_of.axis))
    return given


def _checkpoint_steps(
    tensors: Iterable[tuple[str, Any]], model: LoadedModel, labels: dict[str, str]
) -> Iterator[tuple[str, Any]]:
    """The loaders' steps from a checkpoint's names to jserve's checkpoint names (model. prefix dropped),
    recording in `labels` the given name of each tensor that passes through one to one."""

    def named(pairs):
        for name, array in pairs:
            plain = name
            for prefix, text in TEXT_PREFIXES.items():
                if plain.startswith(prefix):
                    plain = text + plain.removeprefix(prefix)
                    break
            labels[plain.removeprefix("model.")] = name
            yield name, array

    original = model.placement.original
    try:
        steps = offset_norms(
            split_fused_tensors(
                stack_expert_tensors(text_model_tensors(named(tensors), "update"), original, "update"), original
            ),  # fmt: skip
            original,
        )
        for name, array in steps:
            yield name.removeprefix("model."), array
    except ModelLoadError as error:
        raise WeightUpdateError(str(error)) from None
