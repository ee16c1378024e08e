"""Turn a model argument into a local source: a GGUF file, a Hugging Face folder or a jserve Orbax folder
(a hub id found in the Hugging Face cache or downloaded, jserve/loader/hub.py)."""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path

from jserve.errors import ModelLoadError
from jserve.loader.default_model import default_model_path
from jserve.loader.hub import HubModel, hub_model_path
from jserve.loader.random_weights import PREFIX as RANDOM_PREFIX

ORBAX_MARKER = "jserve_config.json"
LOCAL_FORMS = (
    "a Hugging Face folder (config.json + *.safetensors), a .gguf file, or a folder written by `jserve convert`"
)


@dataclass(frozen=True)
class ModelSource:
    kind: str  # "gguf" | "hf" | "orbax" | "random" (path: the shape name)
    path: Path


def resolve_model(
    model: str | os.PathLike | None,
    revision: str | None = None,
    download_dir: str | os.PathLike | None = None,
    gguf_file: str | None = None,
) -> ModelSource:
    """`revision` and `gguf_file` pick from a hub repo (`gguf_file` also from a local folder of several GGUFs);
    `download_dir` is where hub models are looked up and downloaded instead of the Hugging Face cache."""
    if model is None or str(model).startswith(RANDOM_PREFIX):
        if revision is not None or gguf_file is not None:
            raise ModelLoadError("--revision and --gguf-file pick from a hub repo; the default model takes neither")
        if model is None:
            return ModelSource("gguf", default_model_path())
        return ModelSource("random", Path(str(model).removeprefix(RANDOM_PREFIX)))
    path = Path(model).expanduser()
    hub = HubModel.parse(str(model), revision, gguf_file)
    if hub is not None and not path.exists():  # a local path of the same shape comes first
        return ModelSource("gguf" if hub.gguf_file else "hf", hub_model_path(hub, download_dir))
    if revision is not None:
        raise ModelLoadError(f"--revision {revision!r} picks a revision of a hub repo; {str(model)!r} is a local path")
    if gguf_file is not None:
        if not path.is_dir():
            raise ModelLoadError(
                f"--gguf-file {gguf_file!r} picks a file of a hub repo or a local folder; {str(model)!r} is neither"
            )
        path = path / gguf_file
    if path.is_file():
        if path.suffix != ".gguf":
            raise ModelLoadError(f"{path}: a model file must be a .gguf; otherwise pass {LOCAL_FORMS}")
        return ModelSource("gguf", path)
    if path.is_dir():
        if (path / ORBAX_MARKER).is_file():
            return ModelSource("orbax", path)
        if (path / "config.json").is_file():
            return ModelSource("hf", path)
        ggufs = sorted(path.glob("*.gguf"))
        if len(ggufs) == 1:
            return ModelSource("gguf", ggufs[0])
        raise ModelLoadError(
            f"{path}: no config.json, {ORBAX_MARKER} or single .gguf file (of several, --gguf-file picks one); "
            f"expected {LOCAL_FORMS}"
        )
    raise ModelLoadError(f"model path {str(path)!r} does not exist; expected a hub id (org/name) or {LOCAL_FORMS}")
