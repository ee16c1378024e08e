"""The tiled layout of gguf_tiles.h, written from a GGUF tensor's rows (numpy, at load time).

Rows of every format the kernel takes (FIELDS' keys) go to it 16 at a time, block by block. A tile block
holds each field of the 16 rows' blocks in turn: a float16 field as the 16 rows' values one after another,
a field of more bytes as 64-byte vectors whose lane r holds 4 of row r's bytes. Every byte is the file's;
the layout only reorders them (rows padded with zeros to whole tiles).
"""

from __future__ import annotations

import numpy as np
from gguf import GGML_QUANT_SIZES, GGMLQuantizationType

G = GGMLQuantizationType
TILE_ROWS = 16
# Format: its block's fields as (byte offset in ggml's block, bytes), in the order a tile block holds them
# (gguf_tiles.cc's LayoutOf). Each format's block is exactly these fields.
FIELDS = {
    G.Q4_0: ((0, 2), (2, 16)),  # d, codes
    G.Q4_1: ((0, 2), (2, 2), (4, 16)),  # d, m, codes
    G.Q5_0: ((0, 2), (2, 4), (6, 16)),  # d, 5th bits, codes
    G.Q5_1: ((0, 2), (2, 2), (4, 4), (8, 16)),  # d, m, 5th bits, codes
    G.Q8_0: ((0, 2), (2, 32)),  # d, codes
    G.Q4_K: ((0, 2), (2, 2), (4, 12), (16, 128)),  # d, dmin, 6-bit scales and minima, codes
    G.Q5_K: ((0, 2), (2, 2), (4, 12), (16, 32), (48, 128)),  # the same with 5th bits
    # d, int8 scales, then the codes' low 4 and high 2 bits in the order the kernel reads them
    G.Q6_K: ((208, 2), (192, 16), (0, 32), (128, 32), (32, 32), (64, 32), (160, 32), (96, 32)),
}


def tile_rows(ggml_type: int, rows: np.ndarray) -> np.ndarray:
    """Rows [n, bytes per row] of one format as the kernel's flat bytes (n rounded up to 16)."""
    ggml_type = GGMLQuantizationType(ggml_type)
    block_bytes = GGML_QUANT_SIZES[ggml_type][1]
    n, row_bytes = rows.shape
    blocks = row_bytes // block_bytes
    padded = np.zeros((-(-n // TILE_ROWS) * TILE_ROWS, row_bytes), np.uint8)
    padded[:n] = rows
    # [tile, row in tile, block, byte] -> [tile, block, row in tile, byte]
    grouped = padded.reshape(-1, TILE_ROWS, blocks, block_bytes).transpose(0, 2, 1, 3)
    fields = []
    for at, size in FIELDS[ggml_type]:
        lane = min(size, 4)  # [.., row, lanes, lane bytes] -> [.., lanes, row, lane bytes]
        field = grouped[..., at : at + size].reshape(*grouped.shape[:3], size // lane, lane).transpose(0, 1, 3, 2, 4)
        fields.append(field.reshape(*grouped.shape[:2], -1))
    return np.ascontiguousarray(np.concatenate(fields, axis=-1)).reshape(-1)
