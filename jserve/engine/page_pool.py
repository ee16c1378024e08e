"""The KV page pool: O(1) allocate / free with reference counts, so pages can be shared (the prefix cache)."""

from __future__ import annotations

import numpy as np


class OutOfPagesError(RuntimeError):
    pass


class PagePool:
    def __init__(self, num_pages: int):
        self.num_pages = num_pages
        self._free = np.arange(num_pages, dtype=np.int32)[::-1].copy()  # a stack: low ids handed out first
        self._num_free = num_pages
        self.ref_counts = np.zeros(num_pages, np.int32)

    @property
    def num_free(self) -> int:
        return self._num_free

    def allocate(self, n: int) -> np.ndarray:
        if n > self._num_free:
            raise OutOfPagesError(f"asked for {n} KV pages, {self._num_free} free")
        pages = self._free[self._num_free - n : self._num_free][::-1].copy()
        self._num_free -= n
        self.ref_counts[pages] = 1
        return pages

    def share(self, pages: np.ndarray) -> None:
        """Another owner holds these pages too."""
        self.ref_counts[pages] += 1

    def release(self, pages: np.ndarray) -> None:
        """Drop one reference to each page; pages nobody holds go back to the free stack."""
        if len(pages) == 0:
            return
        if np.any(self.ref_counts[pages] <= 0):
            raise ValueError("releasing a KV page that is not allocated")
        self.ref_counts[pages] -= 1
        freed = pages[self.ref_counts[pages] == 0]
        self._free[self._num_free : self._num_free + len(freed)] = freed
        self._num_free += len(freed)
