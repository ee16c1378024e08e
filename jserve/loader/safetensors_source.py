"""Tensors of a Hugging Face folder's *.safetensors files, memory-mapped one at a time.

The format is an 8-byte header length, a JSON header of {name: dtype, shape, data_offsets}, then raw
data. Mapping it with numpy keeps reads lazy and zero-copy, and reads bfloat16 (via ml_dtypes), which
the `safetensors` numpy backend cannot.
"""

from __future__ import annotations

import json
import struct
from collections.abc import Iterator
from pathlib import Path

import ml_dtypes
import numpy as np

from jserve.errors import ModelLoadError

DTYPES = {
    "F64": np.float64,
    "F32": np.float32,
    "F16": np.float16,
    "BF16": ml_dtypes.bfloat16,
    "I64": np.int64,
    "I32": np.int32,
    "I16": np.int16,
    "I8": np.int8,
    "U8": np.uint8,
    "BOOL": np.bool_,
}


INDEX = "model.safetensors.index.json"


def index_shards(index: Path) -> list[str]:
    """The shard file names a safetensors index maps tensors to, in first-use order."""
    try:
        weight_map = json.loads(index.read_text())["weight_map"]
        return list(dict.fromkeys(weight_map.values()))
    except (json.JSONDecodeError, KeyError, TypeError, AttributeError) as err:
        raise ModelLoadError(f"{index}: not a valid safetensors index ({err!r})") from None


def safetensors_files(folder: Path) -> list[Path]:
    """The checkpoint's shard files: from model.safetensors.index.json when present, else every *.safetensors."""
    index = folder / INDEX
    if index.is_file():
        files = [folder / name for name in index_shards(index)]
        missing = [f.name for f in files if not f.is_file()]
        if missing:
            raise ModelLoadError(f"{index} lists shard files that are missing: {', '.join(missing)}")
        return files
    files = sorted(folder.glob("*.safetensors"))
    if not files:
        raise ModelLoadError(f"{folder}: no *.safetensors weights (expected model.safetensors or an index and shards)")
    return files


def _read_header(path: Path) -> tuple[dict, int]:
    size = path.stat().st_size
    with path.open("rb") as f:
        raw = f.read(8)
        if len(raw) < 8:
            raise ModelLoadError(f"{path}: truncated safetensors file ({size} bytes)")
        (header_len,) = struct.unpack("<Q", raw)
        if header_len > size - 8:
            raise ModelLoadError(f"{path}: corrupt safetensors header (length {header_len} > file size {size})")
        try:
            header = json.loads(f.read(header_len))
        except (json.JSONDecodeError, UnicodeDecodeError) as err:
            raise ModelLoadError(f"{path}: corrupt safetensors header ({err})") from None
    header.pop("__metadata__", None)
    data_start = 8 + header_len
    for name, info in header.items():
        begin, end = info["data_offsets"]
        if data_start + end > size:
            raise ModelLoadError(f"{path}: tensor {name!r} runs past the end of the file (truncated download?)")
        if info["dtype"] not in DTYPES:
            raise ModelLoadError(f"{path}: tensor {name!r} has unsupported dtype {info['dtype']}")
    return header, data_start


def count_tensors(files: list[Path]) -> int:
    return sum(len(_read_header(f)[0]) for f in files)


def iter_safetensors(files: list[Path]) -> Iterator[tuple[str, np.ndarray]]:
    """(name, read-only memory-mapped array) for every tensor of every file."""
    for path in files:
        header, data_start = _read_header(path)
        mapped = np.memmap(path, dtype=np.uint8, mode="r")
        for name, info in header.items():
            begin, end = info["data_offsets"]
            raw = mapped[data_start + begin : data_start + end]
            yield name, raw.view(DTYPES[info["dtype"]]).reshape(info["shape"])
