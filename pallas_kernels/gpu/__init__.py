"""Pallas kernels for NVIDIA GPUs (Triton lowering): ragged paged attention, and a single row's RMSNorm
(`rms_norm.py`)."""

from pallas_kernels.gpu.launch import DecodeLaunch, PrefillLaunch
from pallas_kernels.gpu.ragged_paged_attention import SHAPE_REQUIREMENT, ragged_paged_attention, supports

__all__ = ["SHAPE_REQUIREMENT", "DecodeLaunch", "PrefillLaunch", "ragged_paged_attention", "supports"]
