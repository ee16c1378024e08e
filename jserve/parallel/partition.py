"""Megatron-style tensor parallelism over one named mesh axis.

- q/k/v and gate/up are column-parallel (output features split), o and down row-parallel (input features
  split): each layer needs one all-reduce after attention and one after the MLP, which XLA inserts. q/k/v
  and gate/up are fused, one weight each, with rows ordered so each device's block holds its share of every
  piece (models/fused.py).
- Attention heads are split across devices; the KV cache is split by KV head. With fewer KV heads than
  devices, each KV head is replicated (its k/v projection rows repeated at load time) so every device
  holds the KV heads its query heads read. Head counts that do not divide evenly are an error, not padded:
  padding would spend memory and compute on heads that do not exist.
- The embedding is replicated (a lookup needs no communication); an untied LM head is vocab-parallel and
  its logits are gathered by XLA for sampling, which sees the whole vocabulary. A tied head is the
  replicated embedding.
"""

from __future__ import annotations

import dataclasses

import jax
import numpy as np
from jax.sharding import Mesh, NamedSharding, PartitionSpec

from jserve.config import ModelConfig
from jserve.errors import ModelLoadError

MODEL_AXIS = "model"
_COLUMN = ("qkv_proj", "gate_up_proj")
_ROW = ("o_proj", "down_proj")


def make_mesh(tensor_parallel_size: int) -> Mesh | None:
    """A 1-D mesh over the first N devices, or None for one device (no sharding machinery at all). Across
    hosts the mesh spans every device of every process: each must take part in every step."""
    devices = jax.devices()
    if jax.process_count() > 1 and tensor_parallel_size != len(devices):
        raise ValueError(
            f"tensor_parallel_size {tensor_parallel_size}: across {jax.process_count()} processes "
            f"it must be the total device count, {len(devices)}"
        )
    if tensor_parallel_size < 1 or tensor_parallel_size > len(devices):
        raise ValueError(
            f"tensor_parallel_size {tensor_parallel_size} needs 1..{len(devices)} devices "
            f"({len(devices)} {devices[0].platform} devices visible)"
        )
    if tensor_parallel_size == 1:
        return None
    return Mesh(np.array(devices[:tensor_parallel_size]), (MODEL_AXIS,))


def tensor_parallel_config(config: ModelConfig, tp: int) -> ModelConfig:
    """The config as the sharded model sees it (KV heads replicated up to tp), after checking it splits."""
    if tp == 1:
        return config
    for name, count in (("num_heads", config.num_heads), ("intermediate_size", config.intermediate_size)):
        if count % tp:
            raise ModelLoadError(f"{name} {count} does not split over tensor_parallel_size {tp}")
    kv = config.num_kv_heads
    if kv % tp and tp % kv:
        raise ModelLoadError(f"num_kv_heads {kv} neither splits over nor divides tensor_parallel_size {tp}")
    return dataclasses.replace(config, num_kv_heads=max(kv, tp))


def replicate_kv_heads(name: str, array: np.ndarray, original: ModelConfig, sharded: ModelConfig) -> np.ndarray:
    """Repeat each KV head's rows of a checkpoint's k_proj / v_proj (weight or bias) as
    `tensor_parallel_config` asked."""
    repeats = sharded.num_kv_heads // original.num_kv_heads
    if repeats == 1 or not name.endswith(("k_proj.weight", "k_proj.bias", "v_proj.weight", "v_proj.bias")):
        return array
    heads = array.reshape(original.num_kv_heads, original.head_dim, *array.shape[1:])
    return np.repeat(heads, repeats, axis=0).reshape(sharded.num_kv_heads * original.head_dim, *array.shape[1:])


def param_spec(name: str, config: ModelConfig, tp: int) -> PartitionSpec:
    """How the parameter `layers.3.self_attn.qkv_proj.weight` ([out, in] layout) is split."""
    module, _, kind = name.rpartition(".")
    layer = module.rpartition(".")[2]
    if layer in _COLUMN:
        return PartitionSpec(MODEL_AXIS, None) if kind == "weight" else PartitionSpec(MODEL_AXIS)
    if layer in _ROW:
        return PartitionSpec(None, MODEL_AXIS) if kind == "weight" else PartitionSpec()
    if module == "lm_head" and config.vocab_size % tp == 0:
        return PartitionSpec(MODEL_AXIS, None) if kind == "weight" else PartitionSpec(MODEL_AXIS)
    return PartitionSpec()  # embedding, norms (and a head whose vocabulary does not split)


def kv_cache_spec() -> PartitionSpec:
    """KV pages [num_pages, page_size, kv_heads, head_dim], split by KV head."""
    return PartitionSpec(None, None, MODEL_AXIS, None)


@dataclasses.dataclass(frozen=True)
class WeightPlacement:
    """Where each loaded tensor goes: one device, or its shards straight onto the mesh's devices."""

    original: ModelConfig  # as the checkpoint describes it
    config: ModelConfig  # as the (sharded) model is built
    mesh: Mesh | None = None

    @classmethod
    def create(cls, config: ModelConfig, mesh: Mesh | None) -> WeightPlacement:
        return cls(config, tensor_parallel_config(config, mesh.size if mesh else 1), mesh)

    @property
    def shards(self) -> int:
        return self.mesh.size if self.mesh else 1

    def sharding(self, name: str) -> NamedSharding | None:
        return None if self.mesh is None else NamedSharding(self.mesh, param_spec(name, self.config, self.mesh.size))

    def put(self, name: str, array: np.ndarray) -> jax.Array:
        """Place a host tensor; with a mesh each device receives only its own shard."""
        return jax.device_put(array, self.sharding(name))
