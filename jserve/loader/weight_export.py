"""A loaded model's weights handed out: as the engine holds them (`names="jserve"`: the arrays themselves, on
their devices, so a trainer can start from them and hand them back without a copy), or as a Hugging Face
checkpoint names and lays them out (`names="hf"`: host arrays, each loader step undone — fused projections
split, KV heads replicated for tensor parallelism taken once, Gemma's norm offset removed, experts unstacked)."""

from __future__ import annotations

from typing import TYPE_CHECKING

import numpy as np
from flax import nnx

from jserve.config import GEMMA_FAMILIES
from jserve.errors import WeightUpdateError
from jserve.loader.expert_tensors import MIXTRAL_PROJECTIONS
from jserve.loader.weight_update import NAMES
from jserve.loader.weights import checkpoint_tensors, leaves_by_name
from jserve.models.quantization import Quantization

if TYPE_CHECKING:
    from jserve.loader import LoadedModel

KV_PIECES = ("k_proj.weight", "k_proj.bias", "v_proj.weight", "v_proj.bias")
MIXTRAL_NAMES = {projection: name for name, projection in MIXTRAL_PROJECTIONS.items()}  # gate_proj -> w1
FUSED_IN_CHECKPOINT = ("phi3",)  # families whose checkpoints hold q/k/v and gate/up fused
FUSED_PIECES = {"qkv_proj": ("q_proj", "k_proj", "v_proj"), "gate_up_proj": ("gate_proj", "up_proj")}


def model_weights(model: LoadedModel, names: str = "hf") -> dict:
    """{name: array} of the model's current weights (see the module's docstring for `names`)."""
    if names not in NAMES:
        raise WeightUpdateError(f"names must be one of {', '.join(NAMES)}; got {names!r}")
    if names == "jserve":
        return leaves_by_name(model.params)
    if model.quantization is not Quantization.NONE:
        raise WeightUpdateError(
            f"this engine holds {model.quantization.value} weights, not a checkpoint's floats: "
            "names='jserve' returns them as held"
        )
    config, original = model.config, model.placement.original
    repeats = config.num_kv_heads // original.num_kv_heads
    mixtral = config.family == "mixtral"
    weights = {}
    for name, array in checkpoint_tensors(nnx.merge(model.graphdef, model.params)).items():
        if repeats > 1 and name.endswith(KV_PIECES):  # each KV head once, as the checkpoint has it
            heads = array.reshape(config.num_kv_heads, original.head_dim, *array.shape[1:])
            array = heads[::repeats].reshape(-1, *array.shape[1:])
        if config.family in GEMMA_FAMILIES and name.endswith("norm.weight"):
            array = array - np.asarray(1.0, array.dtype)
        prefix = "" if name.startswith("lm_head.") else "model."
        stem, _, projection = name.removesuffix(".weight").rpartition(".")
        if stem.endswith("mlp.experts"):  # stacked [experts, out, in]: one tensor per expert
            for expert, weight in enumerate(np.asarray(array)):
                if mixtral:
                    hf = MIXTRAL_NAMES[projection]
                    weights[f"model.{stem.replace('.mlp.', '.block_sparse_moe.')}.{expert}.{hf}.weight"] = weight
                else:
                    weights[f"model.{stem}.{expert}.{projection}.weight"] = weight
            continue
        if mixtral and name.endswith("mlp.gate.weight"):
            name = name.replace(".mlp.", ".block_sparse_moe.")
        weights[prefix + name] = np.asarray(array)
    return _fused_as_checkpoint(weights) if config.family in FUSED_IN_CHECKPOINT else weights


def _fused_as_checkpoint(weights: dict) -> dict:
    """q/k/v and gate/up as one tensor each, pieces in order, where the family's checkpoints hold them so."""
    for fused, pieces in FUSED_PIECES.items():
        for name in [n for n in weights if f".{pieces[0]}." in n]:
            stem, kind = name.split(f".{pieces[0]}.")
            parts = [weights.pop(f"{stem}.{piece}.{kind}") for piece in pieces]
            weights[f"{stem}.{fused}.{kind}"] = np.concatenate(parts)
    return weights
