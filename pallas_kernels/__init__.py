"""Pallas ragged paged-attention kernels: gpu/ (Triton), mosaic_gpu/ (Hopper, Mosaic GPU), tpu/ (Mosaic).

Each implements the contract of `jserve.attention.paged_attention`, the plain-JAX reference. gpu/ also
holds a single row's RMSNorm (`jserve.models.norm.rms_norm`'s contract), which XLA:GPU splits in two.
"""
