"""Repetition, presence and frequency penalties, and the per-slot token history they read.

The history lives on device across steps, one row per engine slot: which tokens the prompt holds and how
often each token appears in the output. Each step records its input tokens before sampling, so a
sequence's history always covers every token before the one being sampled.
"""

from __future__ import annotations

from dataclasses import dataclass

import jax
import jax.numpy as jnp

from jserve.engine.carried_state import update_if
from jserve.engine.stages import Gate, gated


@jax.tree_util.register_dataclass
@dataclass(frozen=True)
class PenaltyState:
    prompt_mask: jax.Array  # [num_slots, V] bool: the token appears in the prompt
    output_counts: jax.Array  # [num_slots, V] i32: times the token appears in the output


def init_penalty_state(num_slots: int, vocab_size: int) -> PenaltyState:
    shape = (num_slots, vocab_size)
    return PenaltyState(jnp.zeros(shape, jnp.bool_), jnp.zeros(shape, jnp.int32))


def update_penalty_state(
    state: PenaltyState,
    token_ids: jax.Array,
    token_slots: jax.Array,
    is_output: jax.Array,
    recorded: jax.Array,
    reset_slots: jax.Array,
    reset: jax.Array,
    gate: Gate = Gate.WHEN_NEEDED,
) -> PenaltyState:
    """Clears the rows reset_slots[i] where reset[i], then records the input tokens [T] marked `recorded`
    (`gate`: the step's carry stage, see carried_state.update_if).

    Prompt tokens mark prompt_mask, output tokens (generated earlier, fed back) add 1 to output_counts.
    Each token is fed as input exactly once, so counting inputs counts each token once.
    """
    num_slots = state.prompt_mask.shape[0]

    def record(state: PenaltyState) -> PenaltyState:
        # Masked-out entries point one row past the end, where the scatters drop them.
        reset_rows = jnp.where(reset, reset_slots, num_slots)
        prompt_rows = jnp.where(recorded & ~is_output, token_slots, num_slots)
        output_rows = jnp.where(recorded & is_output, token_slots, num_slots)
        prompt_mask = state.prompt_mask.at[reset_rows].set(False, mode="drop")
        output_counts = state.output_counts.at[reset_rows].set(0, mode="drop")
        return PenaltyState(
            prompt_mask.at[prompt_rows, token_ids].set(True, mode="drop"),
            output_counts.at[output_rows, token_ids].add(1, mode="drop"),
        )

    # Clearing rows touches [S, V] of state; a step with nothing to record or clear skips it at run time where
    # that costs no copy (carried_state.py), and otherwise drops every row.
    return update_if(jnp.any(recorded) | jnp.any(reset), record, state, gate=gate)


def apply_penalties(
    logits: jax.Array,
    state: PenaltyState,
    slots: jax.Array,
    repetition: jax.Array,
    presence: jax.Array,
    frequency: jax.Array,
    gate: Gate = Gate.WHEN_NEEDED,
) -> jax.Array:
    """Penalises logits [S, V] of the sequences in slots [S], each with its own penalties [S] (`gate`: whether
    to, see stages.py; neutral penalties leave a row as it is).

    Repetition (HF/vLLM): tokens seen in the prompt or output are divided by the penalty when positive and
    multiplied when not. Presence subtracts once per token in the output, frequency once per occurrence.
    """

    def penalise(logits: jax.Array) -> jax.Array:
        counts = state.output_counts[slots]
        in_output = counts > 0
        seen = state.prompt_mask[slots] | in_output
        rep = repetition[:, None]
        logits = jnp.where(seen, jnp.where(logits > 0, logits / rep, logits * rep), logits)
        return logits - frequency[:, None] * counts - presence[:, None] * in_output

    # Gathering [S, V] of history is skipped when no row has a penalty.
    def active() -> jax.Array:
        return jnp.any((repetition != 1) | (presence != 0) | (frequency != 0))

    return gated(gate, active, lambda: penalise(logits), lambda: logits)
