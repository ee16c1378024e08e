"""Pallas kernels for NVIDIA GPUs (Triton lowering)."""

from pallas_kernels.gpu.ragged_paged_attention import ragged_paged_attention

__all__ = ["ragged_paged_attention"]
