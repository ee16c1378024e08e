"""On the host: a request's chunk statistics combined across its chunks, then its vector: each pooling mode's
part, concatenated, through the Dense layers, normalized (sentence-transformers' order)."""

from __future__ import annotations

import numpy as np

from jserve.pooling.config import PoolingConfig
from jserve.pooling.statistics import STATISTIC, statistics_for


class Pooler:
    def __init__(self, config: PoolingConfig):
        self.config = config
        self.kinds = statistics_for(config.modes)
        self._at = {kind: i for i, kind in enumerate(self.kinds)}

    def combine(self, so_far: np.ndarray | None, chunk: np.ndarray) -> np.ndarray:
        """A request's statistics [K, hidden] after one more chunk's (`so_far` None: this is its first chunk)."""
        if so_far is None:
            return chunk.copy()
        for kind, i in self._at.items():
            if kind == "last":
                so_far[i] = chunk[i]
            elif kind == "max":
                np.maximum(so_far[i], chunk[i], out=so_far[i])
            elif kind in ("sum", "weighted_sum"):
                so_far[i] += chunk[i]
            # "first": the first chunk's stays
        return so_far

    def vectors(self, stats: np.ndarray, lengths: np.ndarray) -> np.ndarray:
        """float32 [N, dimension]: the vectors of N inputs from their whole statistics [N, K, hidden] and
        their lengths in tokens."""
        n = lengths.astype(np.float32)[:, None]
        parts = []
        for mode in self.config.modes:
            part = stats[:, self._at[STATISTIC[mode]]]
            if mode == "mean":
                part = part / n
            elif mode == "mean_sqrt_len_tokens":
                part = part / np.sqrt(n)
            elif mode == "weightedmean":
                part = part / (n * (n + 1) / 2)  # the weights 1 .. n
            parts.append(part)
        x = np.concatenate(parts, axis=1) if len(parts) > 1 else parts[0]
        for layer in self.config.dense:
            x = layer(x)
        return (normalized(x) if self.config.normalize else x).astype(np.float32)


def normalized(x: np.ndarray) -> np.ndarray:
    """Rows scaled to unit L2 norm (a zero row stays zero), as torch's F.normalize."""
    return x / np.maximum(np.linalg.norm(x, axis=-1, keepdims=True), 1e-12)


def cosine(a: np.ndarray, b: np.ndarray) -> float:
    return float(np.dot(a, b) / max(np.linalg.norm(a) * np.linalg.norm(b), 1e-12))


def pair_scores(vectors: list, num_left: int) -> list[float]:
    """Scores as vLLM's score pairs texts: the first `num_left` vectors against the rest, one against each
    (num_left 1) or pairwise."""
    left, right = vectors[:num_left], vectors[num_left:]
    left = left * len(right) if len(left) == 1 else left
    return [cosine(np.asarray(a), np.asarray(b)) for a, b in zip(left, right, strict=True)]
