"""The Mosaic (TPU) Pallas kernel: ragged paged attention over a mixed prefill/decode batch."""

from pallas_kernels.tpu.ragged_paged_attention import ragged_paged_attention, smem_bytes, smem_capacity

__all__ = ["ragged_paged_attention", "smem_bytes", "smem_capacity"]
