"""Pallas paged-attention kernels for GPU and TPU.

They implement the contract of `jserve.attention.paged_attention` (the plain-JAX reference, used on CPU);
the kernels themselves arrive with issue #6.
"""
