"""The engine's one jitted step: run the model on a padded mixed batch, then sample each sequence on device."""

from __future__ import annotations

from dataclasses import dataclass

import jax
from flax import nnx

from jserve.attention import AttentionBackend, KVCache, ModelInput
from jserve.engine.sampler import PenaltyState, SamplerOutput, SamplingBatch, sample, update_penalty_state


@jax.tree_util.register_dataclass
@dataclass(frozen=True)
class PenaltyUpdate:
    """Which penalty-state rows this step's input tokens belong to (see update_penalty_state)."""

    token_slots: jax.Array  # [T]
    is_output: jax.Array  # [T] the token was generated (not part of the prompt)
    valid: jax.Array  # [T] False for padding tokens
    reset_slots: jax.Array  # [S]
    reset: jax.Array  # [S] the sequence starts from position 0: its row starts afresh


@jax.tree_util.register_dataclass
@dataclass(frozen=True)
class StepInput:
    model: ModelInput
    sampling: SamplingBatch
    penalties: PenaltyUpdate


def engine_step(
    graphdef: nnx.GraphDef,
    attention: AttentionBackend,
    params: nnx.State,
    kv_cache: KVCache,
    penalty_state: PenaltyState,
    step: StepInput,
) -> tuple[SamplerOutput, KVCache, PenaltyState]:
    logits, kv_cache = nnx.merge(graphdef, params)(step.model, kv_cache, attention)
    p = step.penalties
    penalty_state = update_penalty_state(
        penalty_state, step.model.token_ids, p.token_slots, p.is_output, p.valid, p.reset_slots, p.reset
    )
    return sample(logits, step.sampling, penalty_state), kv_cache, penalty_state


def jit_engine_step(out_shardings=None):
    """engine_step compiled with the KV cache and penalty state donated. With tensor parallelism the
    runner pins the output shardings to the input ones, so donated state keeps its layout step to step."""
    return jax.jit(engine_step, static_argnums=(0, 1), donate_argnums=(3, 4), out_shardings=out_shardings)
