"""Turn a model argument into a local source: a GGUF file, a Hugging Face folder or a jserve Orbax folder."""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path

from jserve.errors import ModelLoadError
from jserve.loader.default_model import default_model_path
from jserve.loader.random_weights import PREFIX as RANDOM_PREFIX

ORBAX_MARKER = "jserve_config.json"
LOCAL_FORMS = (
    "a Hugging Face folder (config.json + *.safetensors), a .gguf file, or a folder written by `jserve convert`"
)


@dataclass(frozen=True)
class ModelSource:
    kind: str  # "gguf" | "hf" | "orbax" | "random" (path: the shape name)
    path: Path


def hf_hub_cache() -> Path:
    if os.environ.get("HF_HUB_CACHE"):
        return Path(os.environ["HF_HUB_CACHE"])
    return Path(os.environ.get("HF_HOME") or Path.home() / ".cache" / "huggingface") / "hub"


def find_in_hf_cache(repo_id: str) -> Path | None:
    """The snapshot folder of a hub id already in the local Hugging Face cache (refs/main first, else newest)."""
    repo = hf_hub_cache() / f"models--{repo_id.replace('/', '--')}"
    snapshots = repo / "snapshots"
    if not snapshots.is_dir():
        return None
    ref = repo / "refs" / "main"
    if ref.is_file() and (snapshots / ref.read_text().strip()).is_dir():
        return snapshots / ref.read_text().strip()
    candidates = sorted(snapshots.iterdir(), key=lambda p: p.stat().st_mtime)
    return candidates[-1] if candidates else None


def resolve_model(model: str | os.PathLike | None) -> ModelSource:
    if model is None:
        return ModelSource("gguf", default_model_path())
    if str(model).startswith(RANDOM_PREFIX):
        return ModelSource("random", Path(str(model).removeprefix(RANDOM_PREFIX)))
    path = Path(model).expanduser()
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
        raise ModelLoadError(f"{path}: no config.json, {ORBAX_MARKER} or single .gguf file; expected {LOCAL_FORMS}")
    if str(model).count("/") == 1 and not str(model).startswith((".", "/", "~")):
        snapshot = find_in_hf_cache(str(model))
        if snapshot is not None:
            return ModelSource("hf", snapshot)
        raise ModelLoadError(
            f"model {model!r} is not in the local Hugging Face cache ({hf_hub_cache()}) and the hub is not reachable "
            f"from jserve; download it elsewhere and pass its local path: {LOCAL_FORMS}"
        )
    raise ModelLoadError(f"model path {model!r} does not exist; expected {LOCAL_FORMS}")
