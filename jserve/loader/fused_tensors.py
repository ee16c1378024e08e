"""Checkpoints that store projections fused (Phi-3's `qkv_proj` and `gate_up_proj`, llama.cpp's `attn_qkv`):
split into the pieces the assembler matches by name. It fuses them again, in its own row order (which
differs from the checkpoint's under tensor parallelism: models/fused.py)."""

from __future__ import annotations

from collections.abc import Iterable, Iterator

import numpy as np

from jserve.config import ModelConfig
from jserve.loader.gguf_blocks import GgufBlocks


def split_fused_tensors(
    tensors: Iterable[tuple[str, np.ndarray]], config: ModelConfig
) -> Iterator[tuple[str, np.ndarray]]:
    """(name, array) pairs with each fused q/k/v or gate/up tensor (weight or bias) replaced by its pieces."""
    q_rows, kv_rows = config.num_heads * config.head_dim, config.num_kv_heads * config.head_dim
    for name, array in tensors:
        stem, _, kind = name.rpartition(".")
        if stem.endswith("self_attn.qkv_proj"):
            base = stem.removesuffix("qkv_proj")
            for piece, part in zip(("q_proj", "k_proj", "v_proj"), _split(array, [q_rows, q_rows + kv_rows]),
                                   strict=True):  # fmt: skip
                yield f"{base}{piece}.{kind}", part
        elif stem.endswith("mlp.gate_up_proj"):
            base = stem.removesuffix("gate_up_proj")
            gate, up = _split(array, [array.shape[0] // 2])
            yield f"{base}gate_proj.{kind}", gate
            yield f"{base}up_proj.{kind}", up
        else:
            yield name, array


def _split(array: np.ndarray | GgufBlocks, bounds: list[int]) -> list:
    return array.split_rows(bounds) if isinstance(array, GgufBlocks) else np.split(array, bounds)
