"""jserve's own checkpoint format: Orbax params + jserve_config.json + the tokenizer files.

It skips parsing, dequantizing and renaming, so it loads faster than the GGUF or safetensors it came from.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path
from typing import Any

import jax.numpy as jnp
import numpy as np

from jserve.config import ModelConfig
from jserve.errors import ModelLoadError
from jserve.loader.resolve import ORBAX_MARKER
from jserve.loader.weights import abstract_module, checkpoint_tensors, leaves_by_name
from jserve.models import CausalLM

FORMAT_VERSION = 1


def _checkpointer():
    import orbax.checkpoint as ocp  # imported here: 0.3 s that only `jserve convert` folders need

    return ocp.StandardCheckpointer()


def save_orbax(model: CausalLM, tokenizer, dtype, folder: Path) -> None:
    """Write the model's params as the checkpoint names them (fused projections split into their pieces,
    so a folder loads at any tensor-parallel size), its config and its tokenizer."""
    folder = Path(folder).absolute()
    if folder.exists() and any(folder.iterdir()):
        raise FileExistsError(f"{folder} exists and is not empty")
    folder.mkdir(parents=True, exist_ok=True)
    try:
        with _checkpointer() as checkpointer:
            checkpointer.save(folder / "params", _nested(checkpoint_tensors(model)))
        tokenizer.save(folder)
        meta = {"format": FORMAT_VERSION, "dtype": jnp.dtype(dtype).name, "config": model.config.to_dict()}
        (folder / ORBAX_MARKER).write_text(json.dumps(meta, indent=2))  # written last: marks a complete folder
    except BaseException:
        shutil.rmtree(folder, ignore_errors=True)
        raise


def read_orbax_config(folder: Path) -> tuple[ModelConfig, str]:
    path = folder / ORBAX_MARKER
    try:
        meta = json.loads(path.read_text())
        return ModelConfig.from_dict(meta["config"]), meta["dtype"]
    except (json.JSONDecodeError, KeyError, TypeError) as err:
        raise ModelLoadError(f"{path}: not a valid jserve checkpoint description ({err!r})") from None


def read_orbax(folder: Path, config: ModelConfig, dtype: str) -> dict[str, np.ndarray]:
    """The folder's tensors by checkpoint name, in host memory (for loader.weights.assemble)."""
    shapes = checkpoint_tensors(abstract_module(config, jnp.dtype(dtype)))
    target = _nested({name: np.zeros(shape.shape, shape.dtype) for name, shape in shapes.items()})
    try:
        with _checkpointer() as checkpointer:
            restored = checkpointer.restore(folder.absolute() / "params", target)
    except Exception as err:
        raise ModelLoadError(
            f"{folder / 'params'}: cannot restore the Orbax checkpoint ({type(err).__name__}: {err})"
        ) from None
    return leaves_by_name(restored)


def _nested(tensors: dict[str, Any]) -> dict:
    """{'layers.0.mlp.up_proj.weight': x} -> {'layers': {0: {'mlp': {'up_proj': {'weight': x}}}}}: the tree
    `nnx.to_pure_dict` gave format 1's folders."""
    tree: dict = {}
    for name, tensor in tensors.items():
        *parents, leaf = (int(key) if key.isdigit() else key for key in name.split("."))
        node = tree
        for key in parents:
            node = node.setdefault(key, {})
        node[leaf] = tensor
    return tree
