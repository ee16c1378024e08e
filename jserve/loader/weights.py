"""Assemble a CausalLM from named checkpoint tensors: match names, check shapes, cast, fuse, place on device.

The module tree is built abstractly (no memory), then filled one tensor at a time, each converted
straight to its final dtype (a fused projection once all its pieces are in), so peak memory stays near one
copy of the weights.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass

import jax
import numpy as np
from flax import nnx
from tqdm.auto import tqdm

from jserve.config import ModelConfig
from jserve.errors import ModelLoadError
from jserve.loader.gguf_blocks import GgufBlocks, attach_blocks, fuse_blocks
from jserve.models import CausalLM
from jserve.models.fused import fuse
from jserve.models.fused import split as fused_split
from jserve.models.linear import Linear
from jserve.parallel import Parallelism, WeightPlacement, replicate_kv_heads


def param_name(path) -> str:
    """'layers.0.self_attn.q_proj.weight' for a state leaf path (the trailing `.value` attribute dropped)."""
    return ".".join(
        str(getattr(k, "key", getattr(k, "idx", None))) for k in path if not isinstance(k, jax.tree_util.GetAttrKey)
    )


def abstract_module(
    config: ModelConfig, dtype, quantization: str = "none", parallelism: Parallelism | None = None
) -> CausalLM:
    parallelism = parallelism or Parallelism()
    return nnx.eval_shape(lambda: CausalLM(config, dtype=dtype, quantization=quantization, parallelism=parallelism))


def abstract_model(
    config: ModelConfig, dtype, quantization: str = "none", parallelism: Parallelism | None = None
) -> tuple[nnx.GraphDef, nnx.State]:
    return nnx.split(abstract_module(config, dtype, quantization, parallelism))


def leaves_by_name(tree) -> dict:
    """A params tree's leaves (an nnx State, or nested dicts) by dotted name."""
    return {param_name(path): leaf for path, leaf in jax.tree_util.tree_flatten_with_path(tree)[0]}


@dataclass(frozen=True)
class Piece:
    """A checkpoint tensor that a fused parameter holds (k_proj's weight in qkv_proj's)."""

    param: str
    index: int  # among the parameter's pieces
    widths: tuple[int, ...]  # every piece's rows
    shards: int  # the tensor-parallel blocks the rows are ordered for (models/fused.py)
    axis: int  # the rows' axis: 0, or 1 in stacked experts' weights [experts, rows, in]


def fused_pieces(model: CausalLM) -> dict[str, Piece]:
    """Each fused parameter's pieces by checkpoint name: 'layers.0.self_attn.k_proj.bias' ->
    Piece('layers.0.self_attn.qkv_proj.bias', 1, (q rows, k rows, v rows), shards)."""
    pieces = {}
    for path, node in nnx.iter_graph(model):
        if isinstance(node, Linear) and node.pieces:
            fused, names, widths = ".".join(map(str, path)), *zip(*node.pieces, strict=True)
            for kind in ("weight", "bias") if node.bias is not None else ("weight",):
                axis = node.weight.ndim - 2 if kind == "weight" else node.bias.ndim - 1
                for index, name in enumerate(names):
                    piece = Piece(f"{fused}.{kind}", index, widths, node.shards, axis)
                    pieces[f"{fused.rpartition('.')[0]}.{name}.{kind}"] = piece
    return pieces


def checkpoint_tensors(model: CausalLM) -> dict[str, jax.ShapeDtypeStruct | np.ndarray]:
    """The model's params as a checkpoint names them, each fused one as its pieces: of an abstract model their
    shapes, of a loaded one host arrays (gathered from their devices)."""
    tensors = leaves_by_name(nnx.state(model))
    pieces = fused_pieces(model)
    split: dict[str, list[np.ndarray]] = {}  # each fused param's pieces, split once
    for name, piece in pieces.items():
        fused = tensors[piece.param]
        if isinstance(fused, jax.ShapeDtypeStruct):
            shape = list(fused.shape)
            shape[piece.axis] = piece.widths[piece.index]
            tensors[name] = jax.ShapeDtypeStruct(tuple(shape), fused.dtype)
        else:
            if piece.param not in split:
                split[piece.param] = fused_split(np.asarray(fused), piece.widths, piece.shards, axis=piece.axis)
            tensors[name] = split[piece.param][piece.index]
    for piece in pieces.values():
        tensors.pop(piece.param, None)
    return tensors


def assemble(
    placement: WeightPlacement,
    tensors: Iterable[tuple[str, np.ndarray | GgufBlocks]],
    dtype,
    source: str,
    total: int | None = None,
    progress_bar: bool = True,
) -> tuple[nnx.GraphDef, nnx.State]:
    """(graphdef, params) for the placement's config from (name, array) pairs checked against the
    checkpoint's config; names may carry the HF `model.` prefix. GgufBlocks stay blocks (gguf_blocks.py).
    `total`: how many pairs come, for the progress bar (shown unless not `progress_bar`)."""
    config, parallelism = placement.config, placement.parallelism
    model = abstract_module(config, dtype, parallelism=parallelism)
    # Shapes as the checkpoint has them (tensor-parallel padding may have grown the placed ones).
    if placement.original != config:
        original = abstract_module(placement.original, dtype, parallelism=parallelism)
    else:
        original = model
    expected, pieces = checkpoint_tensors(original), fused_pieces(model)
    loaded: dict[str, jax.Array] = {}
    layouts: dict[str, tuple[tuple[int, int], ...]] = {}  # weights kept in GGUF blocks: their segments
    waiting: dict[str, list[np.ndarray | GgufBlocks | None]] = {}  # fused params by name: their pieces so far
    bar = tqdm(tensors, total=total, desc=f"Loading {source}", unit="tensor", leave=False, disable=not progress_bar)
    for name, array in bar:
        key = name.removeprefix("model.")
        if key == "lm_head.weight" and (config.tie_word_embeddings or not config.lm_head):
            continue  # tied: the embedding table is the head; or the model is served without one
        if key.endswith("rotary_emb.inv_freq"):
            continue  # recomputed from the config
        if key not in expected:
            raise ModelLoadError(f"{source}: unexpected tensor {name!r} for a {config.family} model")
        want = expected.pop(key)
        if tuple(array.shape) != tuple(want.shape):
            raise ModelLoadError(
                f"{source}: tensor {name!r} has shape {tuple(array.shape)}, "
                f"expected {tuple(want.shape)} from the config"
            )
        if not isinstance(array, GgufBlocks):
            array = np.asarray(array, dtype=want.dtype)
        if key not in pieces:
            if isinstance(array, GgufBlocks):  # one piece: its bytes, one segment
                array, layouts[key] = fuse_blocks([array])
            loaded[key] = placement.put(key, array)
            continue
        piece = pieces[key]
        parts = waiting.setdefault(piece.param, [None] * len(piece.widths))
        # (blocks load on one device only, where no KV head is replicated)
        parts[piece.index] = replicate_kv_heads(key, array, placement.original, config)
        if all(part is not None for part in parts):
            parts = waiting.pop(piece.param)
            if (blocks := fuse_blocks(parts)) is not None:
                loaded[piece.param], layouts[piece.param] = placement.put(piece.param, blocks[0]), blocks[1]
                continue
            floats = [p.dequantized().astype(want.dtype) if isinstance(p, GgufBlocks) else p for p in parts]
            loaded[piece.param] = placement.put(piece.param, fuse(floats, piece.shards, piece.axis))
    if expected:
        missing = sorted(expected)
        shown = ", ".join(missing[:5]) + (f" and {len(missing) - 5} more" if len(missing) > 5 else "")
        raise ModelLoadError(f"{source}: missing tensors {shown}")
    graphdef, abstract = nnx.split(model)
    params = jax.tree_util.tree_map_with_path(lambda path, _: loaded[param_name(path)], abstract)
    return attach_blocks(graphdef, params, layouts) if layouts else (graphdef, params)
