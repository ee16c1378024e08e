"""An embedding request's options, named as vLLM's PoolingParams."""

from __future__ import annotations

from dataclasses import dataclass

from jserve.errors import RequestError


@dataclass(frozen=True)
class PoolingParams:
    dimensions: int | None = None  # cut the vector to its first so many values (matryoshka models)

    def __post_init__(self):
        d = self.dimensions
        if d is not None and (isinstance(d, bool) or not isinstance(d, int) or d < 1):
            raise RequestError(f"dimensions must be a positive integer, got {d!r:.40}", "dimensions")
