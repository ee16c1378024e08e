"""Hub ids (`org/name`, `org/name:FILE.gguf`): found in the local Hugging Face cache, else downloaded with
huggingface_hub into it.

A model already in the cache loads from there without touching the network. Downloads leave HF_TOKEN,
HF_ENDPOINT and HF_HUB_OFFLINE to huggingface_hub, which reads them itself: no token or endpoint is passed.
"""

from __future__ import annotations

import logging
import os
import re
from dataclasses import dataclass
from pathlib import Path

from jserve.errors import ModelLoadError
from jserve.loader.safetensors_source import INDEX, index_shards, safetensors_files

log = logging.getLogger("jserve")

REPO_ID = re.compile(r"[A-Za-z0-9][\w.-]*/[\w.-]+")
COMMIT = re.compile(r"[0-9a-f]{40}")
CONFIG_FILE = "config.json"
TOKENIZER_FILES = ("tokenizer.json", "tokenizer.model")
# What config.py and tokenizer/tokenizer.py read from a Hugging Face folder; the weights are fetched after these,
# once the index says which shards (a repo may also hold other checkpoints, such as Mistral's consolidated.safetensors).
METADATA_FILES = [CONFIG_FILE, "generation_config.json", INDEX, *TOKENIZER_FILES, "tokenizer_config.json",
                  "special_tokens_map.json", "chat_template.jinja"]  # fmt: skip
SUBFOLDERS = "*/*"  # jserve reads a folder's top level only: original/*.pth, onnx/, ... are never fetched
NO_HUB = "to load without the hub, download the model elsewhere and pass its local folder or .gguf file instead"


@dataclass(frozen=True)
class HubModel:
    repo_id: str
    revision: str | None = None  # a branch, tag or commit; None: the repo's main branch
    gguf_file: str | None = None  # one GGUF file of the repo, loaded instead of its safetensors

    @classmethod
    def parse(cls, model: str, revision: str | None, gguf_file: str | None) -> HubModel | None:
        """The hub model `model` names (`org/name` or `org/name:FILE.gguf`), or None if it names none."""
        repo_id, _, named = model.partition(":")
        if not REPO_ID.fullmatch(repo_id) or (named and not named.endswith(".gguf")):
            return None
        if named and gguf_file and named != gguf_file:
            raise ModelLoadError(f"{model!r} names the GGUF file {named!r} but --gguf-file says {gguf_file!r}")
        return cls(repo_id, revision, named or gguf_file)

    def __str__(self) -> str:
        name = f"{self.repo_id}:{self.gguf_file}" if self.gguf_file else self.repo_id
        return f"{name} (revision {self.revision or 'main'})"


def hf_hub_cache() -> Path:
    """The Hugging Face cache as huggingface_hub places it by default."""
    if os.environ.get("HF_HUB_CACHE"):
        return Path(os.environ["HF_HUB_CACHE"]).expanduser()
    if os.environ.get("HF_HOME"):
        return Path(os.environ["HF_HOME"]).expanduser() / "hub"
    return Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache").expanduser() / "huggingface" / "hub"


def cached_snapshot(cache: Path, repo_id: str, revision: str | None) -> Path | None:
    """The snapshot folder of a revision already in the cache: a commit's own, or the one its branch or tag
    pointed to when last downloaded. Without a revision: main's, else the newest snapshot."""
    repo = cache / f"models--{repo_id.replace('/', '--')}"
    snapshots = repo / "snapshots"
    ref = repo / "refs" / (revision or "main")
    if revision is not None and COMMIT.fullmatch(revision):
        commit = revision
    elif ref.is_file():
        commit = ref.read_text().strip()
    elif revision is None and snapshots.is_dir():
        candidates = sorted(snapshots.iterdir(), key=lambda p: p.stat().st_mtime)
        return candidates[-1] if candidates else None
    else:
        return None
    return snapshots / commit if (snapshots / commit).is_dir() else None


def missing_files(folder: Path) -> list[str]:
    """What a folder lacks to load (empty when complete): a config-only or tokenizer-only download left some."""
    missing = [] if (folder / CONFIG_FILE).is_file() else [CONFIG_FILE]
    try:
        safetensors_files(folder)
    except ModelLoadError:
        missing.append("*.safetensors weights")
    if not any((folder / name).is_file() for name in TOKENIZER_FILES):
        missing.append(" or ".join(TOKENIZER_FILES))
    return missing


def hub_model_path(hub: HubModel, download_dir: str | os.PathLike | None) -> Path:
    """The local folder (or GGUF file) of a hub model: from the cache (`download_dir` when given), else downloaded."""
    cache = Path(download_dir).expanduser() if download_dir is not None else hf_hub_cache()
    snapshot = cached_snapshot(cache, hub.repo_id, hub.revision)
    if snapshot is not None:
        if hub.gguf_file and (snapshot / hub.gguf_file).is_file():
            return snapshot / hub.gguf_file
        if not hub.gguf_file and not missing_files(snapshot):
            return snapshot
    path = download(hub, cache)
    missing = [] if hub.gguf_file else missing_files(path)
    if missing:
        raise ModelLoadError(
            f"{hub} has no {', no '.join(missing)} (jserve reads safetensors checkpoints, or one GGUF file: name it "
            f"as {hub.repo_id}:FILE.gguf or with --gguf-file); {NO_HUB}"
        )
    return path


def download(hub: HubModel, cache: Path) -> Path:
    try:
        from huggingface_hub import constants
    except ImportError:
        raise ModelLoadError(
            f"{hub} is not in the cache {cache}; downloading it needs huggingface_hub "
            f"(pip install huggingface_hub), or {NO_HUB}"
        ) from None
    log.info("Downloading %s from %s into %s", hub, constants.ENDPOINT, cache)
    try:
        return fetch(hub, cache)
    except ModelLoadError:
        raise
    except Exception as err:  # huggingface_hub's own errors, OSError, or its HTTP client's mid-transfer
        raise ModelLoadError(download_error(hub, cache, err)) from None


def fetch(hub: HubModel, cache: Path) -> Path:
    from huggingface_hub import hf_hub_download, snapshot_download

    if hub.gguf_file:
        return Path(hf_hub_download(hub.repo_id, hub.gguf_file, revision=hub.revision, cache_dir=cache))
    folder = Path(snapshot_download(hub.repo_id, revision=hub.revision, cache_dir=cache,
                                    allow_patterns=METADATA_FILES, ignore_patterns=SUBFOLDERS))  # fmt: skip
    index = folder / INDEX
    shards = index_shards(index) if index.is_file() else ["*.safetensors"]
    # The commit the first call resolved (the snapshot's name), wherever the branch has moved since.
    snapshot_download(
        hub.repo_id, revision=folder.name, cache_dir=cache, allow_patterns=shards, ignore_patterns=SUBFOLDERS
    )
    return folder


def download_error(hub: HubModel, cache: Path, err: Exception) -> str:
    """What went wrong, in words: never a bare traceback of the HTTP client."""
    from huggingface_hub import constants
    from huggingface_hub.errors import (
        GatedRepoError,
        RemoteEntryNotFoundError,
        RepositoryNotFoundError,
        RevisionNotFoundError,
    )

    if constants.is_offline_mode():
        why = f"HF_HUB_OFFLINE is set and it is not in the cache {cache}"
    elif isinstance(err, GatedRepoError):
        why = "the repo is gated: accept its terms on its hub page, then set HF_TOKEN to a token of that account"
    elif isinstance(err, RepositoryNotFoundError):
        why = "no such repo, or a private one (set HF_TOKEN to a token that can read it)"
    elif isinstance(err, RevisionNotFoundError):
        why = f"the repo has no revision {hub.revision!r}"
    elif isinstance(err, RemoteEntryNotFoundError):
        why = f"the repo has no file {hub.gguf_file!r}"
    else:  # no connection, a server error, a transfer cut short for good
        lines = str(err).strip().splitlines()
        why = f"the hub could not be reached or the transfer failed ({type(err).__name__}: {lines[0] if lines else ''})"
    return f"could not download {hub} from {constants.ENDPOINT}: {why}; {NO_HUB}"
