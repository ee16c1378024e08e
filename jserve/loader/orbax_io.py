"""jserve's own checkpoint format: Orbax params + jserve_config.json + the tokenizer files.

It skips parsing, dequantizing and renaming, so it loads faster than the GGUF or safetensors it came from.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import jax
import jax.numpy as jnp
from flax import nnx

from jserve.config import ModelConfig
from jserve.errors import ModelLoadError
from jserve.loader.resolve import ORBAX_MARKER
from jserve.loader.weights import abstract_model, param_name
from jserve.parallel import WeightPlacement

FORMAT_VERSION = 1


def _checkpointer():
    import orbax.checkpoint as ocp  # imported here: 0.3 s that only `jserve convert` folders need

    return ocp.StandardCheckpointer()


def save_orbax(config: ModelConfig, params: nnx.State, tokenizer, dtype, folder: Path) -> None:
    folder = Path(folder).absolute()
    if folder.exists() and any(folder.iterdir()):
        raise FileExistsError(f"{folder} exists and is not empty")
    folder.mkdir(parents=True, exist_ok=True)
    try:
        with _checkpointer() as checkpointer:
            checkpointer.save(folder / "params", nnx.to_pure_dict(params))
        tokenizer.save(folder)
        meta = {"format": FORMAT_VERSION, "dtype": jnp.dtype(dtype).name, "config": config.to_dict()}
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


def load_orbax(folder: Path, placement: WeightPlacement, dtype) -> tuple[nnx.GraphDef, nnx.State]:
    """Restore params; with a mesh, Orbax reads each device's shard straight onto it."""
    if placement.config != placement.original:
        raise ModelLoadError(
            f"{folder}: replicating KV heads over tensor_parallel_size {placement.mesh.size} needs the original "
            "checkpoint (GGUF or Hugging Face), not a `jserve convert` folder"
        )
    graphdef, abstract = abstract_model(placement.config, dtype)
    abstract = jax.tree_util.tree_map_with_path(
        lambda path, x: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=placement.sharding(param_name(path))),
        abstract,
    )
    target = nnx.to_pure_dict(abstract)
    try:
        with _checkpointer() as checkpointer:
            restored = checkpointer.restore(folder.absolute() / "params", target)
    except Exception as err:
        raise ModelLoadError(
            f"{folder / 'params'}: cannot restore the Orbax checkpoint ({type(err).__name__}: {err})"
        ) from None
    restored = jax.tree.map(lambda x, want: x.astype(want.dtype), restored, target)
    nnx.replace_by_pure_dict(abstract, restored)
    return graphdef, abstract
