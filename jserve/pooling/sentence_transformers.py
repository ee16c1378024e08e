"""An embedding checkpoint's pooling, read from its sentence-transformers files.

modules.json lists the modules a text goes through: the Transformer (the checkpoint's own model, at the
folder's root), Pooling (1_Pooling/config.json, in the older `pooling_mode_*_tokens` form or the newer
`pooling_mode`), optional Dense layers (their weights in safetensors) and Normalize.
config_sentence_transformers.json holds named prompts, sentence_bert_config.json the input length limit and
lower-casing, and config.json says whether the model was trained to be truncated (matryoshka).
"""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np

from jserve.errors import ModelLoadError
from jserve.loader.safetensors_source import iter_safetensors
from jserve.pooling.config import ACTIVATIONS, POOLING_MODES, DenseLayer, PoolingConfig

LEGACY_MODE_KEYS = {
    "pooling_mode_cls_token": "cls",
    "pooling_mode_max_tokens": "max",
    "pooling_mode_mean_tokens": "mean",
    "pooling_mode_mean_sqrt_len_tokens": "mean_sqrt_len_tokens",
    "pooling_mode_weightedmean_tokens": "weightedmean",
    "pooling_mode_lasttoken": "lasttoken",
}


def read_pooling_config(folder: Path) -> PoolingConfig | None:
    """The folder's pooling, or None when it has no sentence-transformers modules (or none that pools)."""
    modules_file = folder / "modules.json"
    if not modules_file.is_file():
        return None
    modules = _json(modules_file)
    if not isinstance(modules, list):
        raise ModelLoadError(f"{modules_file}: expected a list of modules")
    kinds = [(str(m.get("type", "")).rpartition(".")[2], m.get("path", "")) for m in modules]
    if not any(kind == "Pooling" for kind, _ in kinds):
        return None
    modes, dense, normalize = None, [], False
    for kind, path in kinds:
        where = folder / path
        if kind in ("Dense", "Normalize") and modes is None:
            raise ModelLoadError(f"{modules_file}: {kind} before Pooling is not supported")
        if kind == "Transformer":
            if path:
                raise ModelLoadError(f"{modules_file}: the transformer is in {path!r}; load that folder's model")
        elif kind == "Pooling":
            modes = _pooling_modes(where / "config.json")
        elif kind == "Dense":
            dense.append(_dense_layer(where))
        elif kind == "Normalize":
            normalize = True
        else:
            raise ModelLoadError(f"{modules_file}: sentence-transformers module {kind!r} is not supported "
                                 "(jserve runs Transformer, Pooling, Dense and Normalize)")  # fmt: skip
    settings = _json(folder / "config_sentence_transformers.json", {})
    bert = _json(folder / "sentence_bert_config.json", {})
    prompts = settings.get("prompts") or {}
    return PoolingConfig(
        modes=modes,
        normalize=normalize,
        dense=tuple(dense),
        matryoshka_dimensions=_matryoshka(_json(folder / "config.json", {})),
        prompts={str(name): str(text) for name, text in prompts.items()},
        default_prompt_name=settings.get("default_prompt_name"),
        max_seq_length=bert.get("max_seq_length"),
        lower_case=bool(bert.get("do_lower_case", False)),
        message_format=_message_format(bert, folder / "sentence_bert_config.json"),
        source="sentence-transformers files",
    )


def _pooling_modes(path: Path) -> tuple[str, ...]:
    config = _json(path)
    if not config.get("include_prompt", True):
        raise ModelLoadError(f"{path}: pooling that leaves out the prompt's tokens (include_prompt false) is not "
                             "supported")  # fmt: skip
    if "pooling_mode" in config:
        mode = config["pooling_mode"]
        modes = (mode,) if isinstance(mode, str) else tuple(mode)
    else:
        modes = tuple(mode for key, mode in LEGACY_MODE_KEYS.items() if config.get(key)) or ("mean",)
    unknown = [mode for mode in modes if mode not in POOLING_MODES]
    if unknown:
        raise ModelLoadError(f"{path}: pooling mode {unknown[0]!r} is none of {', '.join(POOLING_MODES)}")
    return modes


def _dense_layer(folder: Path) -> DenseLayer:
    config = _json(folder / "config.json")
    activation = str(config.get("activation_function", "torch.nn.modules.activation.Tanh")).rpartition(".")[2]
    if activation not in ACTIVATIONS:
        raise ModelLoadError(f"{folder}: activation {activation!r} is none of {', '.join(ACTIVATIONS)}")
    files = sorted(folder.glob("*.safetensors"))
    if not files:
        raise ModelLoadError(f"{folder}: no model.safetensors (a Dense layer saved as pytorch_model.bin only: load "
                             "and save it again with sentence-transformers to write safetensors)")  # fmt: skip
    tensors = {name: np.array(array, np.float32) for name, array in iter_safetensors(files)}
    weight = tensors.get("linear.weight")
    expected = (config.get("out_features"), config.get("in_features"))
    if weight is None or weight.shape != expected:
        raise ModelLoadError(f"{folder}: linear.weight must be {expected}, the layer's (out, in) features")
    return DenseLayer(weight, tensors.get("linear.bias") if config.get("bias", True) else None, activation,
                      bool(config.get("use_residual", False)), tensors.get("residual.weight"))  # fmt: skip


def _message_format(bert: dict, path: Path) -> str | None:
    """sentence-transformers >= 6 saves which inputs its Transformer takes; with a "message" modality (a
    tokenizer with a chat template) it sends every text through the chat template, as a user message."""
    message = (bert.get("modality_config") or {}).get("message")
    if message is None:
        return None
    form = message.get("format", "auto")
    if form not in ("flat", "structured"):
        raise ModelLoadError(f"{path}: message format {form!r} is not supported (flat or structured)")
    return form


def _matryoshka(config: dict) -> tuple[int, ...] | None:
    """config.json's matryoshka_dimensions (those a vector may be cut to) or is_matryoshka (any), as vLLM
    reads them."""
    if dims := config.get("matryoshka_dimensions"):
        return tuple(int(d) for d in dims)
    return () if config.get("is_matryoshka") else None


def _json(path: Path, default=None):
    if not path.is_file():
        if default is not None:
            return default
        raise ModelLoadError(f"{path}: missing")
    try:
        return json.loads(path.read_text())
    except (json.JSONDecodeError, UnicodeDecodeError) as err:
        raise ModelLoadError(f"{path}: not valid JSON ({err})") from None
