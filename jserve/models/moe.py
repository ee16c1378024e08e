"""A mixture-of-experts MLP (Mixtral, Qwen3-MoE): a router picks each token's top-k experts, the (token,
expert) rows are sorted by expert, and the experts' gated MLPs run as grouped matmuls over the sorted rows
(grouped_matmul.py): fixed shapes per step bucket, and a cost that grows with the rows routed.

On a mesh the experts run under shard_map, each device on its own weights: with tensor parallelism a slice
of every expert's MLP, with expert parallelism (`--enable-expert-parallel`) whole experts, the rows routed
elsewhere left out. Each device's partial output is weighted and summed over the devices (one all-reduce,
as after a dense MLP). The router runs replicated: every device sees the same routing.
"""

from __future__ import annotations

from functools import partial

import jax
import jax.numpy as jnp
from flax import nnx
from jax.sharding import PartitionSpec

from jserve.config import ModelConfig
from jserve.models.grouped_matmul import grouped_gated_matmul, grouped_matmul
from jserve.models.linear import Linear
from jserve.models.norm import RMSNorm
from jserve.models.quantization import Quantization
from jserve.parallel import MODEL_AXIS, Parallelism, expert_spec


class ExpertProjection(Linear):
    """One projection of every expert: a Linear whose weight is stacked [experts, out, in] ([experts, out]
    scales when quantized), applied to rows sorted by expert."""

    def __call__(self, rows: jax.Array, group_sizes: jax.Array) -> jax.Array:
        return grouped_matmul(rows, self.weight[...], group_sizes, self._scale(), self.activation_group)

    def gated(self, rows: jax.Array, group_sizes: jax.Array, gelu: bool) -> jax.Array:
        """act(gate) * up of this fused gate and up projection. Under shard_map each device holds one block of
        the fused rows, its share of each piece (fused.py): gate's, then up's, as grouped_gated_matmul takes them."""
        scale, activation_group = self._scale(), self.activation_group
        return grouped_gated_matmul(rows, self.weight[...], group_sizes, scale, activation_group, gelu)

    def _scale(self) -> jax.Array | None:
        return None if self.weight_scale is None else self.weight_scale[...]


class Experts(nnx.Module):
    def __init__(self, config: ModelConfig, *, dtype, quantization: Quantization, shards: int):
        hidden, inner, count = config.hidden_size, config.moe_intermediate_size, config.num_experts
        pieces = {"gate_proj": inner, "up_proj": inner}
        common = dict(bias=False, dtype=dtype, quantization=quantization, experts=count)
        self.gate_up_proj = ExpertProjection(hidden, pieces, shards=shards, **common)
        self.down_proj = ExpertProjection(inner, hidden, **common)
        self.gelu = config.hidden_activation == "gelu_tanh"

    def __call__(self, rows: jax.Array, group_sizes: jax.Array) -> jax.Array:
        """The gated MLP of each row's expert ([R, hidden] sorted by expert; rows past the groups give zeros)."""
        return self.down_proj(self.gate_up_proj.gated(rows, group_sizes, self.gelu), group_sizes)


class SparseMoE(nnx.Module):
    def __init__(self, config: ModelConfig, *, dtype, quantization: Quantization, parallelism: Parallelism):
        # The router stays in float, as the checkpoint has it: which experts run hangs on its ranking.
        none = Quantization.NONE
        self.gate = Linear(config.hidden_size, config.num_experts, bias=False, dtype=dtype, quantization=none)
        shards = 1 if parallelism.expert_parallel else parallelism.shards  # fused rows ordered for TP shards
        self.experts = Experts(config, dtype=dtype, quantization=quantization, shards=shards)
        self.top_k, self.normalize = config.num_experts_per_tok, config.norm_topk_prob
        self.parallelism = parallelism

    def __call__(
        self, x: jax.Array, real_rows: jax.Array | None = None, norm: RMSNorm | None = None, adapters=None
    ) -> jax.Array:
        """moe(norm(x)), or moe(x); `real_rows` (int32 [1]): x's rows past it are padding, routed nowhere.
        (`adapters`: as a dense MLP takes them; an adapter of expert projections is refused when it loads, so
        none reach here.)"""
        x = x if norm is None else norm(x)
        with jax.named_scope("routing"):  # (scopes name the step's parts in profiles: benchmarks/step_profile.py)
            weights, chosen = self.route(x, real_rows)
        mesh = self.parallelism.mesh
        if mesh is None:
            return _combine(_run_experts(self.experts, x, chosen, 0), weights)
        graphdef, state = nnx.split(self.experts)
        ep = self.parallelism.expert_parallel
        specs = jax.tree_util.tree_map_with_path(lambda path, _: _state_spec(path, ep), state)
        local = partial(_run_on_device, graphdef, expert_parallel=ep)
        sharded = jax.shard_map(local, mesh=mesh, in_specs=(specs, PartitionSpec(), PartitionSpec(), PartitionSpec()),
                                out_specs=PartitionSpec(), check_vma=False)  # fmt: skip
        return sharded(state, x, weights, chosen)

    def route(self, x: jax.Array, real_rows: jax.Array | None) -> tuple[jax.Array, jax.Array]:
        """(float32 weights [T, k], experts int32 [T, k]) of each token: softmax over all experts, the top k,
        renormalized over those if the model says so; padding rows get the no-expert id num_experts."""
        logits = self.gate(x).astype(jnp.float32)
        if self.normalize:  # the top k of a softmax, renormalized, are the softmax of the top k logits
            top, chosen = jax.lax.top_k(logits, self.top_k)
            weights = jax.nn.softmax(top, axis=-1)
        else:
            weights, chosen = jax.lax.top_k(jax.nn.softmax(logits, axis=-1), self.top_k)
        if real_rows is not None:
            padding = jnp.arange(x.shape[0]) >= real_rows[0]
            chosen = jnp.where(padding[:, None], logits.shape[-1], chosen)
        return weights, chosen.astype(jnp.int32)


def _run_experts(experts: Experts, x: jax.Array, chosen: jax.Array, first: jax.Array | int) -> jax.Array:
    """Each (token, choice)'s expert output [T, k, hidden] from the experts held here, the ones numbered
    from `first`; choices of other experts (and padding) come back as zeros."""
    tokens, k = chosen.shape
    order, group_sizes = _sort_by_expert(chosen, first, held=experts.down_proj.weight.shape[0])
    with jax.named_scope("experts"):
        out = experts(x[order // k], group_sizes)
    return _unsort(out, order).reshape(tokens, k, -1)


@jax.named_scope("routing")
def _sort_by_expert(chosen: jax.Array, first: jax.Array | int, held: int) -> tuple[jax.Array, jax.Array]:
    """(the (token, choice) rows in order of expert [T * k], the rows of each expert held here [held])."""
    local = chosen.reshape(-1) - first
    local = jnp.where((local >= 0) & (local < held), local, held)  # elsewhere: sorted last, in no group
    order = jnp.argsort(local, stable=True)
    return order, jnp.bincount(local, length=held + 1)[:held].astype(jnp.int32)


@jax.named_scope("routing")
def _unsort(out: jax.Array, order: jax.Array) -> jax.Array:
    """The sorted rows back in (token, choice) order, gathered through the inverse permutation (XLA fuses the
    gather into the weighted sum that reads them). Scattered back, they would need a zeroed buffer a layer,
    and XLA:GPU makes every layer's zeros in one kernel at the start of the step, all live at once: compiled
    for an H200, Qwen3-30B-A3B's temporaries at 2,048 tokens a step were 3.9 GB that way, 0.9 GB this way
    (for two small kernels a layer more)."""
    inverse = jnp.argsort(order).astype(jnp.uint32)  # (unsigned: no test for negative indices, a kernel of its own)
    return out[inverse]


@jax.named_scope("routing")
def _combine(outputs: jax.Array, weights: jax.Array) -> jax.Array:
    """sum over the k choices of weight * expert output, in float32 -> [T, hidden] in the outputs' dtype."""
    return jnp.einsum("tkh,tk->th", outputs.astype(jnp.float32), weights).astype(outputs.dtype)


def _run_on_device(graphdef, state, x, weights, chosen, *, expert_parallel: bool) -> jax.Array:
    experts = nnx.merge(graphdef, state)
    held = experts.down_proj.weight.shape[0]
    first = jax.lax.axis_index(MODEL_AXIS) * held if expert_parallel else 0
    return jax.lax.psum(_combine(_run_experts(experts, x, chosen, first), weights), MODEL_AXIS)


def _state_spec(path, expert_parallel: bool) -> PartitionSpec:
    keys = [getattr(key, "key", None) for key in path]
    projection = "gate_up_proj" if "gate_up_proj" in keys else "down_proj"
    return expert_spec(projection, "weight_scale" if "weight_scale" in keys else "weight", expert_parallel)
