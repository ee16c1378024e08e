"""Pallas kernels for NVIDIA Hopper GPUs (Mosaic GPU lowering), the successor of the Triton ones in
`pallas_kernels.gpu` (Pallas deprecates its Triton backend from jax 0.11)."""

from pallas_kernels.mosaic_gpu.ragged_paged_attention import INTERPRETABLE, ragged_paged_attention, supports

__all__ = ["INTERPRETABLE", "ragged_paged_attention", "supports"]
