"""The engine's one jitted step: run the model (models.forward) on a padded mixed batch, then sample each
sequence on device.

Besides the KV cache and the penalty state, the step carries its sampled token ids to the next step on the
device, so a token sampled by step N can be step N+1's input before the host has fetched it (async
scheduling): the host marks such inputs with the row of step N's samples that holds them.

A row with a grammar whose previous token is still in flight cannot have its token bitmask at launch (the
grammar has not seen that token). Rather than wait for it, the step keeps the row's logits in the carry, and
`sample_deferred` samples them once the host has fetched the previous step and filled the mask, before the
next step reads the row's token: every other row keeps its overlap.

With speculative decoding the step also samples at each draft's position, exactly as a decode step there
would (same options, same seeded key), so the host accepts a draft when it equals that sample: the output
is the one decoding without speculation gives, and for a deterministic proposal (q one-hot) accepting with
probability p(draft) and otherwise drawing from p without the draft is rejection sampling's rule. A proposer
that runs on the device (engine/speculation.py: a draft model) sees the step's tokens and makes the next step's
proposals inside it.
"""

from __future__ import annotations

from dataclasses import dataclass, replace

import jax
import jax.numpy as jnp
from flax import nnx

from jserve.attention import AttentionBackend, KVCache, ModelInput, cache_writer_compiler_options
from jserve.engine.carried_state import update_if
from jserve.engine.prompt_logprobs import PromptScores, score_positions
from jserve.engine.sampler import (
    PenaltyState,
    SamplerOutput,
    SamplingBatch,
    no_samples,
    pack_samples,
    sample,
    update_penalty_state,
)
from jserve.engine.speculation import DeviceProposer, ProposingRows
from jserve.engine.stages import Gate, StepStages
from jserve.engine.step_packing import PackedStep, StepPacking
from jserve.models.forward import forward_states
from jserve.models.low_rank import Adapters, SlotWeights


@jax.tree_util.register_dataclass
@dataclass(frozen=True)
class PenaltyUpdate:
    """Which penalty-state rows this step's input tokens belong to (see update_penalty_state)."""

    token_slots: jax.Array  # [T]
    is_output: jax.Array  # [T] the token was generated (not part of the prompt)
    recorded: jax.Array  # [T] the token's request has penalties (False for the others and for padding)
    reset_slots: jax.Array  # [S]
    reset: jax.Array  # [S] the sequence starts from position 0: its row starts afresh


@jax.tree_util.register_dataclass
@dataclass(frozen=True)
class VerifyInput:
    """Where the step samples again to verify draft tokens: row r samples at step token positions[r] (the
    token before a draft) with the options of sampling row rows[r] (its request's) at output index steps[r];
    R rows per bucket (0 without speculation). Few arrays, since each costs host time per step to pass."""

    positions: jax.Array  # [R] i32, -1 = unused row
    rows: jax.Array  # [R] i32
    steps: jax.Array  # [R] i32
    token_bitmask: jax.Array  # [R, ceil(V / 32)] i32
    constrained: jax.Array  # [R] bool


@jax.tree_util.register_dataclass
@dataclass(frozen=True)
class StepInput:
    model: ModelInput
    sampling: SamplingBatch
    penalties: PenaltyUpdate
    pending_rows: jax.Array  # [T] i32: -1, or the row of the previous step's samples that is this token
    prompt_targets: jax.Array  # [T] i32: the prompt token that follows this one, to score; -1: none
    verify: VerifyInput
    proposing: ProposingRows  # D rows per bucket (0 without a device proposer)
    deferred: jax.Array  # [S] bool: the row's grammar mask comes later; its logits stay for sample_deferred
    adapter_slots: jax.Array  # [T] i32: the LoRA adapter slot each token's request reads, -1: none


@jax.tree_util.register_dataclass
@dataclass(frozen=True)
class StepOutput:
    samples: jax.Array  # [S, 2 + 2 * MAX_LOGPROBS] i32 (sampler.pack_samples): row i for the step's sequence i
    verified: jax.Array  # [R, ...] packed, the samples at draft positions, each speculating sequence's in turn
    proposals: jax.Array  # [D, k] i32: the device proposer's proposals for the next step ([0, 0] without one)
    scores: PromptScores  # by position in the step's tokens


@jax.tree_util.register_dataclass
@dataclass(frozen=True)
class Sampled:
    """What a step leaves on the device for the next: each row's sampled id, and the logits of its deferred rows."""

    token_ids: jax.Array  # [S_max] i32
    held_logits: jax.Array  # [S_max, V] f32: meaningful in the latest step's deferred rows only


def init_sampled(num_rows: int, vocab_size: int) -> Sampled:
    """The carry: one row per sequence slot of the largest bucket."""
    return Sampled(jnp.zeros(num_rows, jnp.int32), jnp.zeros((num_rows, vocab_size), jnp.float32))


def engine_step(
    graphdef: nnx.GraphDef,
    attention: AttentionBackend,
    params_def: jax.tree_util.PyTreeDef,
    proposer: DeviceProposer | None,
    packing: StepPacking,
    stages: StepStages,
    params: list[jax.Array],
    proposer_params: list[jax.Array],
    adapter_weights: SlotWeights | None,
    kv_cache: KVCache,
    proposer_kv: KVCache,
    penalty_state: PenaltyState,
    sampled: Sampled,
    packed: PackedStep,
) -> tuple[StepOutput, KVCache, KVCache, PenaltyState, Sampled]:
    step: StepInput = packing.unpack(packed)
    rows = step.pending_rows
    token_ids = jnp.where(rows >= 0, sampled.token_ids[jnp.maximum(rows, 0)], step.model.token_ids)
    model_input = replace(step.model, token_ids=token_ids)
    params_tree = jax.tree_util.tree_unflatten(params_def, params)
    adapters = None if adapter_weights is None else Adapters(step.adapter_slots, adapter_weights)
    logits, hidden, head, kv_cache = forward_states(graphdef, params_tree, kv_cache, model_input, attention, adapters)
    with jax.named_scope("prompt_scores"):  # (scopes name the step's parts in profiles: benchmarks/step_profile.py)
        scores = score_positions(head, hidden, step.prompt_targets, stages.prompt_scores)
    with jax.named_scope("sampling"):
        p = step.penalties
        penalty_state = update_penalty_state(
            penalty_state, token_ids, p.token_slots, p.is_output, p.recorded, p.reset_slots, p.reset, stages.carry
        )
        out = sample(logits, step.sampling, penalty_state, stages)
        verified = verify_drafts(head, hidden, step.verify, step.sampling, penalty_state)
    proposals = jnp.zeros((0, 0), jnp.int32)
    if proposer is not None:
        with jax.named_scope("proposer"):
            proposer_kv = proposer.extend(proposer_params, proposer_kv, model_input, attention)
            if step.proposing.rows.shape[0]:
                proposals, proposer_kv = proposer.propose(
                    proposer_params, proposer_kv, attention, model_input, step.proposing, out.token_ids,
                    verified.token_ids, step.verify.positions, step.sampling,
                    lambda logits, batch: sample(logits, batch, penalty_state),
                )  # fmt: skip
    num_rows = out.token_ids.shape[0]
    with jax.named_scope("sampling"):
        held = hold_logits(sampled.held_logits, logits, step.deferred, stages.carry)
        # (a concatenation, not `.at[:num_rows].set`: XLA:GPU makes that update a memcpy outside the step's
        # CUDA graph, splitting it in two)
        tokens = jnp.concatenate([out.token_ids, sampled.token_ids[num_rows:]])
        sampled = Sampled(tokens, held)
    outputs = StepOutput(pack_samples(out), pack_samples(verified), proposals, scores)
    return outputs, kv_cache, proposer_kv, penalty_state, sampled


def hold_logits(held: jax.Array, logits: jax.Array, deferred: jax.Array, gate: Gate = Gate.WHEN_NEEDED) -> jax.Array:
    """The step's logits [R, V] written over the first R rows of `held` when a row defers its sampling
    (`deferred` [R]), for sample_deferred; else `held` as it is (written in place: the carry is donated).
    `gate`: the step's carry stage (carried_state.update_if)."""
    num_rows = logits.shape[0]
    deferring, logits = jnp.any(deferred), jnp.asarray(logits, jnp.float32)
    rows = jnp.where(deferring, jnp.arange(num_rows), held.shape[0])  # (the masked form's: past the end, dropped)
    return update_if(
        deferring,
        lambda held: held.at[:num_rows].set(logits),
        held,
        masked=lambda held: held.at[rows].set(logits, mode="drop"),
        gate=gate,
    )


def sample_deferred(
    sampled: Sampled, penalty_state: PenaltyState, sampling: SamplingBatch, rows: jax.Array
) -> tuple[jax.Array, Sampled]:
    """Samples the held logits of the latest step's rows `rows` ([D] i32, -1 = padding) with `sampling` ([D]
    rows: their options and, now, their token bitmasks), and writes the tokens where the next step reads them;
    returns the samples packed (sampler.pack_samples)."""
    out = sample(sampled.held_logits[jnp.maximum(rows, 0)], sampling, penalty_state)
    at = jnp.where(rows >= 0, rows, sampled.token_ids.shape[0])  # padding rows point past the end: dropped
    return pack_samples(out), Sampled(sampled.token_ids.at[at].set(out.token_ids, mode="drop"), sampled.held_logits)


def jit_sample_deferred(out_shardings=None):
    """sample_deferred compiled with the carry donated (see jit_engine_step for the shardings)."""
    return jax.jit(sample_deferred, donate_argnums=(0,), out_shardings=out_shardings)


def verify_drafts(
    head, hidden: jax.Array, verify: VerifyInput, sampling: SamplingBatch, penalty_state: PenaltyState
) -> SamplerOutput:
    """Samples at the verify rows' positions (skipped at run time when the step has no drafts)."""
    count = verify.positions.shape[0]
    if count == 0:
        return no_samples(0)

    def verify_rows() -> SamplerOutput:
        batch = jax.tree.map(lambda column: column[verify.rows], sampling)
        batch = replace(batch, steps=verify.steps, token_bitmask=verify.token_bitmask, constrained=verify.constrained)
        return sample(head(hidden[jnp.maximum(verify.positions, 0)]), batch, penalty_state)

    return jax.lax.cond(jnp.any(verify.positions >= 0), verify_rows, lambda: no_samples(count))


def jit_engine_step(out_shardings=None, platform: str = "cpu"):
    """engine_step compiled with the carried state (KV caches, penalty state, sampled ids) donated, for the
    optional stages it is given (static: stages.py). The parameters come as a flat list, their structure
    static: flattening the model's State on every call cost about 0.75 ms of host time per step; the step's
    own host arrays come packed (step_packing.py). With tensor parallelism the runner pins the output
    shardings to the input ones, so donated state keeps its layout step to step. `platform`: the one it
    compiles for (see cache_writer_compiler_options)."""
    return jax.jit(
        engine_step,
        static_argnums=(0, 1, 2, 3, 4, 5),
        donate_argnums=(9, 10, 11, 12),
        out_shardings=out_shardings,
        compiler_options=cache_writer_compiler_options(platform),
    )
