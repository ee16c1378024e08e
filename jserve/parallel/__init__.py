"""Tensor parallelism: the device mesh and how weights and the KV cache are laid out over it."""

from jserve.parallel.partition import (
    MODEL_AXIS,
    Parallelism,
    WeightPlacement,
    expert_spec,
    kv_cache_spec,
    make_mesh,
    param_spec,
    replicate_kv_heads,
    tensor_parallel_config,
)

__all__ = [
    "MODEL_AXIS",
    "Parallelism",
    "WeightPlacement",
    "expert_spec",
    "kv_cache_spec",
    "make_mesh",
    "param_spec",
    "replicate_kv_heads",
    "tensor_parallel_config",
]
