"""The device's adapter slots: every slot's weights in fixed-shape arrays the step reads (models/low_rank.py),
which adapter each slot holds, and how many running requests hold it there.

The scheduler asks before admitting a request whether its adapter has a slot or can get one (a slot held by
no running request), tells when it admits one (the adapter is written into a slot then, if it is not in
one already: the least recently used free slot) and when a request stops running. A request's slot never
changes while it runs, so its step rows read the same slot from admission to finish or preemption.
"""

from __future__ import annotations

import itertools
import logging
from dataclasses import dataclass
from functools import partial

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import NamedSharding, PartitionSpec

from jserve import cpu_kernels
from jserve.config import ModelConfig
from jserve.lora.peft import PROJECTION_PIECES, AdapterWeights
from jserve.models.low_rank import LowRank, SlotWeights
from jserve.parallel.partition import MODEL_AXIS, WeightPlacement, replicate_kv_heads

log = logging.getLogger("jserve")

COLUMN_PARALLEL = ("qkv_proj", "gate_up_proj")  # (row parallel: o_proj, down_proj; see parallel/partition.py)
HostSlot = tuple[dict[str, LowRank], ...]  # one adapter's arrays for one slot: numpy, without the slot axis


@dataclass(frozen=True)
class SlotLayout:
    """The slot arrays' shapes: per layer, each projection's (input features, rows of each piece), as served."""

    slots: int
    rank: int
    layers: tuple[dict[str, tuple[int, tuple[int, ...]]], ...]

    @staticmethod
    def of(config: ModelConfig, slots: int, rank: int) -> SlotLayout:
        q, kv = config.num_heads * config.head_dim, config.num_kv_heads * config.head_dim
        hidden, inner = config.hidden_size, config.intermediate_size
        layers = []
        for layer in range(config.num_layers):
            projections = {"qkv_proj": (hidden, (q, kv, kv)), "o_proj": (q, (hidden,))}
            if not config.has_experts(layer):
                projections |= {"gate_up_proj": (hidden, (inner, inner)), "down_proj": (inner, (hidden,))}
            layers.append(projections)
        return SlotLayout(slots, rank, tuple(layers))

    def host(self, adapter: AdapterWeights, placement: WeightPlacement) -> HostSlot:
        """An adapter's weights for one slot: rank padded with zeros, pieces it does not adapt zero, and KV
        heads repeated as the served model repeats them (tensor parallelism)."""
        layers = []
        for index, projections in enumerate(self.layers):
            arrays = {}
            for name, (inputs, rows) in projections.items():
                pieces = adapter.projections.get((index, name), (None,) * PROJECTION_PIECES[name])
                a = np.zeros((len(rows), self.rank, inputs), np.float32)
                b = [np.zeros((self.rank, width), np.float32) for width in rows]
                for p, piece in enumerate(pieces):
                    if piece is not None:
                        down, up = piece
                        if name == "qkv_proj" and p:  # k, v
                            up = replicate_kv_heads("k_proj.weight", up, placement.original, placement.config)
                        a[p, : down.shape[0]], b[p][: up.shape[1]] = down, up.T
                arrays[name] = LowRank(a.reshape(-1, inputs), tuple(b))
            layers.append(arrays)
        return tuple(layers)

    def shardings(self, placement: WeightPlacement):
        """Column-parallel projections: B split by rows, as the weight is; row parallel: A by input features."""
        mesh = placement.mesh

        def spec(name: str, pieces: int) -> LowRank:
            column = name in COLUMN_PARALLEL
            a = PartitionSpec() if column else PartitionSpec(None, None, MODEL_AXIS)
            b = PartitionSpec(None, None, MODEL_AXIS) if column else PartitionSpec()
            return LowRank(NamedSharding(mesh, a), tuple(NamedSharding(mesh, b) for _ in range(pieces)))

        return tuple({name: spec(name, len(rows)) for name, (_, rows) in layer.items()} for layer in self.layers)


class AdapterSlots:
    def __init__(self, layout: SlotLayout, dtype, placement: WeightPlacement):
        self.layout, self.placement = layout, placement
        shardings = layout.shardings(placement) if placement.mesh else None
        # jserve's C++ kernel on one CPU device; XLA's matmuls elsewhere (low_rank.py)
        cpu_kernel = placement.mesh is None and jax.default_backend() == "cpu" and cpu_kernels.available()
        zeros = tuple(
            {name: LowRank(jnp.zeros((layout.slots, len(rows) * layout.rank, inputs), dtype),
                           tuple(jnp.zeros((layout.slots, layout.rank, width), dtype) for width in rows))
             for name, (inputs, rows) in projections.items()}
            for projections in layout.layers
        )  # fmt: skip
        if shardings is not None:
            zeros, shardings = jax.device_put(zeros, shardings), SlotWeights(shardings, cpu_kernel)
        self.weights = SlotWeights(zeros, cpu_kernel)
        self._write = jax.jit(_write_slot, donate_argnums=0, out_shardings=shardings)
        self.held: list[object | None] = [None] * layout.slots  # the adapter in each slot (ServedAdapter)
        self.pins = np.zeros(layout.slots, np.int64)  # running requests reading each slot
        self.last_used = np.zeros(layout.slots, np.int64)
        self._clock = itertools.count(1)
        self.loads = 0  # adapters written into a slot, for logs and tests

    # The scheduler's questions (Scheduler.gate).

    def can_admit(self, request) -> bool:
        adapter = request.adapter
        return adapter is None or adapter in self.held or bool((self.pins == 0).any())

    def admitted(self, request) -> None:
        adapter = request.adapter
        if adapter is None:
            return
        slot = next((i for i, held in enumerate(self.held) if held is adapter), None)
        if slot is None:
            slot = self._load(adapter)
        self.pins[slot] += 1
        self.last_used[slot] = next(self._clock)
        request.adapter_slot = slot

    def released(self, request) -> None:
        if request.adapter is not None:
            self.pins[request.adapter_slot] -= 1
            request.adapter_slot = -1

    def _load(self, adapter) -> int:
        """Write the adapter into the free slot used least recently (an empty one first)."""
        free = np.flatnonzero(self.pins == 0)
        slot = int(free[np.argmin(self.last_used[free])])
        self.weights = self._write(self.weights, slot, adapter.host_slot)
        if self.held[slot] is not None:
            log.info("LoRA slot %d: %s replaces %s", slot, adapter.name, self.held[slot].name)
        self.held[slot] = adapter
        self.loads += 1
        return slot

    def check_idle(self) -> None:
        assert not self.pins.any(), f"adapter slots still held: {self.pins.tolist()}"


def _write_slot(weights: SlotWeights, slot, host: HostSlot) -> SlotWeights:
    """Every projection's slot `slot` set to the adapter's arrays."""
    write = partial(_write_projection, slot=slot)
    layers = jax.tree.map(write, weights.layers, host, is_leaf=lambda x: isinstance(x, LowRank))
    return SlotWeights(layers, weights.cpu_kernel)


def _write_projection(weights: LowRank, host: LowRank, slot) -> LowRank:
    a = weights.a.at[slot].set(host.a.astype(weights.a.dtype))
    return LowRank(a, tuple(b.at[slot].set(new.astype(b.dtype)) for b, new in zip(weights.b, host.b, strict=True)))
