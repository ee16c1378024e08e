"""Gemma checkpoints store each RMSNorm's weight as w for a scale of (1 + w); jserve's norms scale by their
weight, so w + 1 is what they load (as llama.cpp's converter stores them in GGUF files)."""

from __future__ import annotations

from collections.abc import Iterable, Iterator

import numpy as np

from jserve.config import GEMMA_FAMILIES, ModelConfig


def offset_norms(tensors: Iterable[tuple[str, np.ndarray]], config: ModelConfig) -> Iterator[tuple[str, np.ndarray]]:
    """(name, array) pairs with every norm weight shifted by one, for families that store them so."""
    for name, array in tensors:
        if config.family in GEMMA_FAMILIES and name.endswith("norm.weight"):
            array = np.asarray(array, np.float32) + 1.0
        yield name, array
