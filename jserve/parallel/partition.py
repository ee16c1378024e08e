"""Megatron-style tensor parallelism over one named mesh axis.

- q/k/v and gate/up are column-parallel (output features split), o and down row-parallel (input features
  split): each layer needs one all-reduce after attention and one after the MLP, which XLA inserts. q/k/v
  and gate/up are fused, one weight each, with rows ordered so each device's block holds its share of every
  piece (models/fused.py).
- Attention heads are split across devices; the KV cache is split by KV head. With fewer KV heads than
  devices, each KV head is replicated (its k/v projection rows repeated at load time) so every device
  holds the KV heads its query heads read. Head counts that do not divide evenly are an error, not padded:
  padding would spend memory and compute on heads that do not exist.
- Mixture-of-experts layers: the router is replicated. With tensor parallelism each expert's MLP splits
  like a dense one (gate/up by output features, down by input features); with expert parallelism
  (`--enable-expert-parallel`) whole experts are split across devices instead. Either way each device
  computes its part of every routed token and one all-reduce sums them (models/moe.py).
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


def tensor_parallel_config(config: ModelConfig, tp: int, expert_parallel: bool = False) -> ModelConfig:
    """The config as the sharded model sees it (KV heads replicated up to tp), after checking it splits."""
    if expert_parallel and not config.num_experts:
        raise ModelLoadError("expert parallelism needs a mixture-of-experts model (this one has no experts)")
    if tp == 1:
        return config
    splits = [("num_heads", config.num_heads)]
    if not all(config.has_experts(i) for i in range(config.num_layers)):
        splits.append(("intermediate_size", config.intermediate_size))
    if config.num_experts:
        splits.append(("num_experts", config.num_experts) if expert_parallel
                      else ("moe_intermediate_size", config.moe_intermediate_size))  # fmt: skip
    for name, count in splits:
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


def param_spec(name: str, config: ModelConfig, tp: int, expert_parallel: bool = False) -> PartitionSpec:
    """How the parameter `layers.3.self_attn.qkv_proj.weight` ([out, in] layout) is split."""
    module, _, kind = name.rpartition(".")
    layer = module.rpartition(".")[2]
    if ".experts." in name:
        return expert_spec(layer, kind, expert_parallel)
    if layer in _COLUMN:
        return PartitionSpec(MODEL_AXIS, None) if kind == "weight" else PartitionSpec(MODEL_AXIS)
    if layer in _ROW:
        return PartitionSpec(None, MODEL_AXIS) if kind == "weight" else PartitionSpec()
    if module == "lm_head" and config.vocab_size % tp == 0:
        return PartitionSpec(MODEL_AXIS, None) if kind == "weight" else PartitionSpec(MODEL_AXIS)
    return PartitionSpec()  # embedding, norms (and a head whose vocabulary does not split)


def expert_spec(projection: str, kind: str, expert_parallel: bool) -> PartitionSpec:
    """How an expert projection's stacked `weight` [experts, out, in] or `weight_scale` [experts, out] is
    split: by expert, or each expert's like a dense projection's."""
    if expert_parallel:
        return PartitionSpec(MODEL_AXIS)
    if projection in _COLUMN:
        return PartitionSpec(None, MODEL_AXIS)
    return PartitionSpec(None, None, MODEL_AXIS) if kind == "weight" else PartitionSpec()


def kv_cache_spec() -> PartitionSpec:
    """KV pages [pages, page_size, kv_heads, head_dim] (every layer's: see KVPages), split by KV head."""
    return PartitionSpec(None, None, MODEL_AXIS, None)


@dataclasses.dataclass(frozen=True)
class Parallelism:
    """How a model's layers run over devices: the mesh (None: one device) and, for a mixture of experts,
    whether its experts are split across the devices (expert parallel) or each expert is (tensor parallel).
    Static: the model's structure holds it, and its layers shard_map over the mesh where XLA's automatic
    partitioning would gather whole weights."""

    mesh: Mesh | None = None
    expert_parallel: bool = False

    @property
    def shards(self) -> int:
        return self.mesh.size if self.mesh else 1


@dataclasses.dataclass(frozen=True)
class WeightPlacement:
    """Where each loaded tensor goes: one device, or its shards straight onto the mesh's devices."""

    original: ModelConfig  # as the checkpoint describes it
    config: ModelConfig  # as the (sharded) model is built
    mesh: Mesh | None = None
    expert_parallel: bool = False

    @classmethod
    def create(cls, config: ModelConfig, mesh: Mesh | None, expert_parallel: bool = False) -> WeightPlacement:
        sharded = tensor_parallel_config(config, mesh.size if mesh else 1, expert_parallel)
        return cls(config, sharded, mesh, expert_parallel)

    @property
    def shards(self) -> int:
        return self.mesh.size if self.mesh else 1

    @property
    def parallelism(self) -> Parallelism:
        return Parallelism(self.mesh, self.expert_parallel)

    def sharding(self, name: str) -> NamedSharding | None:
        if self.mesh is None:
            return None
        return NamedSharding(self.mesh, param_spec(name, self.config, self.mesh.size, self.expert_parallel))

    def put(self, name: str, array: np.ndarray) -> jax.Array:
        """Place a host tensor; with a mesh each device receives only its own shard."""
        return jax.device_put(array, self.sharding(name))
