"""PEFT LoRA folders (adapter_config.json + adapter_model.safetensors) read into jserve's projections.

Each adapted module's `lora_A` [r, in] and `lora_B` [out, r] go to the projection jserve holds it in: q/k/v
into the fused qkv_proj, gate/up into gate_up_proj, as pieces (low_rank.py); a checkpoint that fuses them
itself (Phi-3's qkv_proj, gate_up_proj) gives each piece its rows of B and the one A. The scale (lora_alpha / r,
or / sqrt(r) with rsLoRA; per module under alpha_pattern / rank_pattern) is folded into B. Everything is
checked against the base model before anything reaches a device, and refused naming what does not fit.
"""

from __future__ import annotations

import json
import math
import os
import re
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from jserve.config import ModelConfig
from jserve.errors import JServeError
from jserve.loader.safetensors_source import iter_safetensors

CONFIG_FILE, WEIGHTS_FILE = "adapter_config.json", "adapter_model.safetensors"
# checkpoint module -> (jserve projection, piece); the fused checkpoints' modules -> their pieces
PIECES = {"q_proj": ("qkv_proj", 0), "k_proj": ("qkv_proj", 1), "v_proj": ("qkv_proj", 2), "o_proj": ("o_proj", 0),
          "gate_proj": ("gate_up_proj", 0), "up_proj": ("gate_up_proj", 1), "down_proj": ("down_proj", 0)}  # fmt: skip
FUSED_MODULES = {"qkv_proj": ("q_proj", "k_proj", "v_proj"), "gate_up_proj": ("gate_proj", "up_proj")}
MODULES = (*PIECES, *FUSED_MODULES)
PROJECTION_PIECES = {"qkv_proj": 3, "o_proj": 1, "gate_up_proj": 2, "down_proj": 1}
TENSOR = re.compile(r".*\blayers\.(\d+)\.(?:self_attn|mlp)\.(\w+)\.lora_([AB])\.weight")


class AdapterError(JServeError, ValueError):
    """An adapter that cannot be served on this model: its message says what does not fit."""


@dataclass(frozen=True)
class AdapterWeights:
    """An adapter as the projections take it: per (layer, projection), each piece's (A [r, in], scaled B
    [out, r]) in float32, or None for a piece it does not adapt."""

    rank: int
    modules: tuple[str, ...]  # the checkpoint modules it adapts, for the load log line
    projections: dict[tuple[int, str], tuple[tuple[np.ndarray, np.ndarray] | None, ...]]


def read_adapter(folder: str | os.PathLike, base: ModelConfig, max_rank: int) -> AdapterWeights:
    """The PEFT LoRA adapter in `folder`, checked against the base model's config (as its checkpoint has it) and
    the engine's maximum rank."""
    folder = Path(folder)
    config_path, weights_path = folder / CONFIG_FILE, folder / WEIGHTS_FILE
    if not config_path.is_file():
        raise AdapterError(f"{folder} has no {CONFIG_FILE}: a LoRA adapter is a PEFT folder")
    if not weights_path.is_file():
        pickled = (folder / "adapter_model.bin").is_file()
        what = "only adapter_model.bin (resave it with safetensors)" if pickled else "none"
        raise AdapterError(f"{folder} has no {WEIGHTS_FILE}: jserve reads safetensors adapters; it has {what}")
    config = json.loads(config_path.read_text())
    check_config(config, folder)
    a, b = {}, {}
    for name, tensor in iter_safetensors([weights_path]):
        match = TENSOR.fullmatch(name)
        if match is None and ".experts." in name:
            raise AdapterError(f"{folder}: {name} adapts a mixture of experts' expert weights; jserve adapts the "
                               "attention projections (and dense MLP layers) of such models")  # fmt: skip
        if match is None:
            raise AdapterError(f"{folder}: {name} is not a LoRA weight of an attention or MLP projection "
                               "(embeddings, the head and extra trained modules are not served)")  # fmt: skip
        layer, module, which = int(match[1]), match[2], match[3]
        if module not in MODULES:
            raise AdapterError(
                f"{folder}: unknown target module {module!r} in {name}; jserve adapts {', '.join(PIECES)}"
            )
        (a if which == "A" else b)[layer, module] = np.asarray(tensor, np.float32)
    if a.keys() != b.keys():
        raise AdapterError(f"{folder}: lora_A and lora_B are not given for the same modules")
    if not a:
        raise AdapterError(f"{folder}: {WEIGHTS_FILE} holds no LoRA weights")
    projections: dict[tuple[int, str], list] = {}
    rank = 0
    for (layer, module), down in sorted(a.items()):
        up = b[layer, module]
        where = f"{folder}: layers.{layer}.{module}"
        if layer >= base.num_layers:
            raise AdapterError(f"{where}: the base model has {base.num_layers} layers (an adapter for another base?)")
        r = down.shape[0]
        if up.ndim != 2 or down.ndim != 2 or up.shape[1] != r:
            raise AdapterError(f"{where}: lora_A {down.shape} and lora_B {up.shape} are not a rank-r pair")
        if r > max_rank:
            raise AdapterError(f"{where}: rank {r} is above --max-lora-rank {max_rank}")
        rank = max(rank, r)
        scale = module_scale(config, f"layers.{layer}.{module}", r)
        pieces = FUSED_MODULES.get(module, (module,))
        rows = [piece_rows(base, layer, piece) for piece in pieces]
        if down.shape[1] != (inputs := input_features(base, module)) or up.shape[0] != sum(rows):
            raise AdapterError(f"{where}: lora_A {down.shape} and lora_B {up.shape} do not fit the base model's "
                               f"[{sum(rows)}, {inputs}] projection (an adapter for another base?)")  # fmt: skip
        for piece, up_rows in zip(pieces, np.split(up, np.cumsum(rows)[:-1]), strict=True):
            projection, index = PIECES[piece]
            entry = projections.setdefault((layer, projection), [None] * PROJECTION_PIECES[projection])
            entry[index] = (down, up_rows * np.float32(scale))
    modules = tuple(sorted({module for _, module in a}))
    return AdapterWeights(rank, modules, {key: tuple(value) for key, value in projections.items()})


def check_config(config: dict, folder: Path) -> None:
    """Refuse what jserve does not serve, by name: other PEFT methods, DoRA, trained biases, extra modules."""
    kind = config.get("peft_type", "LORA")
    if kind != "LORA":
        raise AdapterError(f"{folder}: peft_type {kind}: jserve serves LoRA adapters only")
    refused = {"use_dora": "DoRA", "fan_in_fan_out": "fan_in_fan_out (Conv1D) weights", "lora_bias": "LoRA biases",
               "modules_to_save": "modules_to_save (fully trained extra modules)"}  # fmt: skip
    for key, what in refused.items():
        if config.get(key):
            raise AdapterError(f"{folder}: {what} are not supported ({key} in {CONFIG_FILE})")
    if config.get("bias", "none") != "none":
        raise AdapterError(f"{folder}: bias {config['bias']!r}: jserve serves adapters with bias 'none'")
    targets = config.get("target_modules")
    if isinstance(targets, list):
        unknown = sorted(set(targets) - set(MODULES))
        if unknown:
            raise AdapterError(f"{folder}: unknown target modules {', '.join(unknown)}; jserve adapts "
                               f"{', '.join(PIECES)} (and a checkpoint's fused qkv_proj, gate_up_proj)")  # fmt: skip


def module_scale(config: dict, module: str, rank: int) -> float:
    """lora_alpha / r (rsLoRA: / sqrt(r)), with the alpha of the first alpha_pattern key the module matches,
    as PEFT matches them (the key ends the module's name)."""
    alpha = config.get("lora_alpha", 8)
    for key, value in (config.get("alpha_pattern") or {}).items():
        if re.match(rf"(.*\.)?({key})$", module):
            alpha = value
            break
    return alpha / (math.sqrt(rank) if config.get("use_rslora") else rank)


def input_features(base: ModelConfig, module: str) -> int:
    if module == "o_proj":
        return base.num_heads * base.head_dim
    if module == "down_proj":
        return base.intermediate_size
    return base.hidden_size


def piece_rows(base: ModelConfig, layer: int, piece: str) -> int:
    if piece in ("gate_proj", "up_proj", "down_proj") and base.has_experts(layer):
        raise AdapterError(f"layers.{layer}.mlp.{piece}: the layer is a mixture of experts; jserve adapts its "
                           "attention projections only")  # fmt: skip
    if piece == "q_proj":
        return base.num_heads * base.head_dim
    if piece in ("k_proj", "v_proj"):
        return base.num_kv_heads * base.head_dim
    if piece in ("gate_proj", "up_proj"):
        return base.intermediate_size
    return base.hidden_size  # o_proj, down_proj
