"""`--quantization gguf`: a GGUF file's projection and embedding weights kept in their block formats.

The GGUF source yields such a tensor as `GgufBlocks` (its rows' bytes, the format, the logical shape)
instead of dequantizing it; the assembler places the bytes as a flat uint8 array (a fused projection's
pieces back to back, a segment per piece) and `attach_blocks` tells each Linear or Embedding holding one
its layout, which it then multiplies with jserve's C++ kernel (cpu_kernels/gguf_linear.cc). Tensors in
formats the kernel lacks, and fused projections whose pieces are not all blocks, are dequantized as usual.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np
from flax import nnx
from gguf import GGML_QUANT_SIZES, GGMLQuantizationType
from gguf.quants import dequantize

from jserve.cpu_kernels import gguf_tiles
from jserve.models.embedding import Embedding
from jserve.models.linear import Linear

G = GGMLQuantizationType
KERNEL_TYPES = tuple(gguf_tiles.FIELDS)  # the formats gguf_linear.cc multiplies


@dataclass(frozen=True)
class GgufBlocks:
    """Rows of a weight in one block format: data [rows, bytes per row] uint8, `depth` weights per row."""

    ggml_type: int
    data: np.ndarray
    depth: int

    @property
    def shape(self) -> tuple[int, int]:
        return self.data.shape[0], self.depth

    def split_rows(self, bounds: Sequence[int]) -> list[GgufBlocks]:
        return [GgufBlocks(self.ggml_type, part, self.depth) for part in np.split(self.data, bounds)]

    def permute_rows(self, permute) -> GgufBlocks:
        """The rows reordered by `permute` (a function of an array of rows, as the GGUF source's Q/K fix)."""
        return GgufBlocks(self.ggml_type, permute(self.data), self.depth)

    def dequantized(self) -> np.ndarray:
        return dequantize(self.data, GGMLQuantizationType(self.ggml_type)).reshape(self.shape)


def keeps_blocks(ggml_type, shape: Sequence[int]) -> bool:
    """Whether a GGUF tensor of this type and (rows, depth) shape stays in blocks."""
    return ggml_type in KERNEL_TYPES and len(shape) == 2 and shape[1] % GGML_QUANT_SIZES[ggml_type][0] == 0


def fuse_blocks(pieces: Sequence[GgufBlocks | np.ndarray]) -> tuple[np.ndarray, tuple[tuple[int, int], ...]] | None:
    """The flat bytes and (type, rows) segments of a fused projection's pieces, adjacent pieces of one
    format merged, each run laid out in the kernel's tiles (cpu_kernels/gguf_tiles.py); None if any piece
    is float (the caller dequantizes the others)."""
    if not all(isinstance(piece, GgufBlocks) for piece in pieces):
        return None
    runs: list[tuple[int, list[np.ndarray]]] = []  # adjacent pieces of one format: one segment
    for piece in pieces:
        if runs and runs[-1][0] == piece.ggml_type:
            runs[-1][1].append(piece.data)
        else:
            runs.append((piece.ggml_type, [piece.data]))
    rows = [(ggml_type, np.concatenate(parts)) for ggml_type, parts in runs]
    flat = [gguf_tiles.tile_rows(t, r) for t, r in rows]
    return np.concatenate(flat), tuple((t, r.shape[0]) for t, r in rows)


def attach_blocks(graphdef: nnx.GraphDef, params: nnx.State, layouts: dict[str, tuple[tuple[int, int], ...]]):
    """(graphdef, params) with each Linear and Embedding whose weight the assembler placed as blocks told
    its layout (`layouts`: segments by weight name)."""
    model = nnx.merge(graphdef, params)
    for path, node in nnx.iter_graph(model):
        name = ".".join(map(str, path)) + ".weight"
        if name not in layouts:
            continue
        if isinstance(node, Linear):
            node.segments = layouts[name]
        elif isinstance(node, Embedding):
            ((node.ggml_type, _),) = layouts[name]
    return nnx.split(model)
