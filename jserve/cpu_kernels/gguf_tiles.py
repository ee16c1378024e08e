"""The tiled layout of gguf_tiles.h, written from a GGUF tensor's rows (numpy, at load time).

Q4_0, Q4_1 and Q8_0 rows go to the kernel 16 at a time, block by block: a tile block is the 16 rows'
float16 scales (and Q4_1's minima), then their codes as 64-byte vectors whose lane r holds 4 code bytes of
row r. Every byte is the file's; the layout only reorders them (rows padded with zeros to whole tiles).
"""

from __future__ import annotations

import numpy as np
from gguf import GGML_QUANT_SIZES, GGMLQuantizationType

G = GGMLQuantizationType
TILE_ROWS = 16
# Format: bytes of a block's scale (and minimum) before its codes.
TILED = {G.Q4_0: 2, G.Q4_1: 4, G.Q8_0: 2}


def tiled(ggml_type: int) -> bool:
    return ggml_type in TILED


def tile_rows(ggml_type: int, rows: np.ndarray) -> np.ndarray:
    """Rows [n, bytes per row] of a tiled format as the kernel's flat bytes (n rounded up to 16)."""
    ggml_type = GGMLQuantizationType(ggml_type)
    header, block_bytes = TILED[ggml_type], GGML_QUANT_SIZES[ggml_type][1]
    n, row_bytes = rows.shape
    blocks = row_bytes // block_bytes
    padded = np.zeros((-(-n // TILE_ROWS) * TILE_ROWS, row_bytes), np.uint8)
    padded[:n] = rows
    # [tile, row in tile, block, byte] -> [tile, block, row in tile, byte]
    grouped = padded.reshape(-1, TILE_ROWS, blocks, block_bytes).transpose(0, 2, 1, 3)
    heads = grouped[..., :header].reshape(*grouped.shape[:3], header // 2, 2)  # d (and m) per row
    heads = heads.transpose(0, 1, 3, 2, 4)  # [tile, block, d/m, row, 2]: 16 scales, then 16 minima
    codes = grouped[..., header:].reshape(*grouped.shape[:3], -1, 4).transpose(0, 1, 3, 2, 4)  # [.., vector, row, 4]
    tiles = np.concatenate([heads.reshape(*grouped.shape[:2], -1), codes.reshape(*grouped.shape[:2], -1)], axis=-1)
    return np.ascontiguousarray(tiles).reshape(-1)
