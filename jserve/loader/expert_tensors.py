"""Mixture-of-experts checkpoints store each expert's projections apart: `mlp.experts.3.gate_proj.weight`
(Qwen3-MoE), or Mixtral's `block_sparse_moe.experts.3.w1.weight` (w1 gate, w3 up, w2 down) beside its router
`block_sparse_moe.gate`. Gathered here into the stacked tensors jserve's model holds, one per projection
(`mlp.experts.gate_proj.weight` [experts, out, in]), which the assembler then fuses like any other pieces;
transformers 5's stacked tensors (its models' state_dict) are split into the same."""

from __future__ import annotations

import re
from collections.abc import Iterable, Iterator

import numpy as np

from jserve.config import ModelConfig
from jserve.errors import ModelLoadError

EXPERT_TENSOR = re.compile(r"(.*\.mlp\.experts)\.(\d+)\.(\w+)\.weight")
# transformers 5 holds each projection's experts stacked already, gate and up fused: `mlp.experts.gate_up_proj`
# [experts, 2 * intermediate, hidden] (gate rows first) and `mlp.experts.down_proj` (its state_dict's names).
STACKED_TENSOR = re.compile(r"(.*\.mlp\.experts)\.(gate_up_proj|down_proj)")
MIXTRAL_PROJECTIONS = {"w1": "gate_proj", "w3": "up_proj", "w2": "down_proj"}


def stack_expert_tensors(
    tensors: Iterable[tuple[str, np.ndarray]], config: ModelConfig, source: str
) -> Iterator[tuple[str, np.ndarray]]:
    """(name, array) pairs with each projection's per-expert tensors replaced by one stacked tensor, yielded
    once its last expert is read (so at most one layer's projection waits in memory)."""
    count = config.num_experts
    waiting: dict[str, list[np.ndarray | None]] = {}
    for name, array in tensors:
        name = name.replace(".block_sparse_moe.", ".mlp.")
        if count and (stacked := STACKED_TENSOR.fullmatch(name)):
            stem, projection = stacked.groups()
            if projection == "down_proj":
                yield f"{stem}.down_proj.weight", array
            else:
                gate, up = np.split(np.asarray(array), 2, axis=1)
                yield f"{stem}.gate_proj.weight", gate
                yield f"{stem}.up_proj.weight", up
            continue
        match = EXPERT_TENSOR.fullmatch(name)
        if not count or match is None:
            yield name, array
            continue
        stem, expert, projection = match.groups()
        if int(expert) >= count:
            raise ModelLoadError(f"{source}: tensor {name!r} names expert {expert} of a model with {count} experts")
        stacked = f"{stem}.{MIXTRAL_PROJECTIONS.get(projection, projection)}.weight"
        experts = waiting.setdefault(stacked, [None] * count)
        experts[int(expert)] = array
        if all(e is not None for e in experts):
            yield stacked, np.stack(waiting.pop(stacked))
    for stacked, experts in waiting.items():
        missing = [str(i) for i, e in enumerate(experts) if e is None]
        raise ModelLoadError(f"{source}: {stacked} lacks experts {', '.join(missing)}")
