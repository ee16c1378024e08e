"""The step's carried state updated without a conditional, as GPUs run it (carried_state.update_if): the masked
updates must equal the conditional ones, and leave the state untouched when a step has nothing to write.

GPUs pick the masked form when the step is lowered for them; here `platform_dependent` is made to pick it on
the CPU, so the very functions the engine compiles run both ways.
"""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jserve.engine.penalties import init_penalty_state, update_penalty_state
from jserve.engine.stages import Gate
from jserve.engine.step import hold_logits

SLOTS, VOCAB, TOKENS = 6, 50, 8


def both_ways(monkeypatch, fn, *args):
    """fn(*args) with the conditional (this CPU's form), then with the masked form."""
    conditional = fn(*args)
    with monkeypatch.context() as patch:
        patch.setattr(jax.lax, "platform_dependent", lambda *a, **branches: branches["cuda"](*a))
        masked = fn(*args)
    return conditional, masked


def assert_same(a, b):
    for x, y in zip(jax.tree.leaves(a), jax.tree.leaves(b), strict=True):
        np.testing.assert_array_equal(np.asarray(x), np.asarray(y))


def penalty_state(rng):
    state = init_penalty_state(SLOTS, VOCAB)
    return type(state)(jnp.asarray(rng.random((SLOTS, VOCAB)) < 0.3), jnp.asarray(rng.integers(0, 4, (SLOTS, VOCAB))))


def tokens(rng):
    """A step's token ids, their slots and which are outputs."""
    ids, slots = rng.integers(0, VOCAB, TOKENS), rng.integers(0, SLOTS, TOKENS)
    return jnp.asarray(ids), jnp.asarray(slots), jnp.asarray(rng.random(TOKENS) < 0.5)


def test_a_penalty_update_with_nothing_to_record_leaves_the_state(monkeypatch):
    rng = np.random.default_rng(0)
    state = penalty_state(rng)
    nothing = np.zeros(TOKENS, bool)
    args = (state, *tokens(rng), jnp.asarray(nothing), jnp.arange(SLOTS), jnp.zeros(SLOTS, bool))
    conditional, masked = both_ways(monkeypatch, update_penalty_state, *args)
    assert_same(conditional, state)
    assert_same(masked, state)


def test_a_penalty_update_records_and_resets_alike_both_ways(monkeypatch):
    rng = np.random.default_rng(1)
    state = penalty_state(rng)
    recorded = rng.random(TOKENS) < 0.6
    reset = np.array([True, False, False, True, False, False])
    args = (state, *tokens(rng), jnp.asarray(recorded), jnp.arange(SLOTS), jnp.asarray(reset))
    conditional, masked = both_ways(monkeypatch, update_penalty_state, *args)
    assert_same(masked, conditional)
    assert not np.array_equal(np.asarray(conditional.output_counts), np.asarray(state.output_counts))


@pytest.mark.parametrize("deferred", [[False, False, False], [False, True, False]])
def test_held_logits_are_written_alike_both_ways(monkeypatch, deferred):
    rng = np.random.default_rng(2)
    held = jnp.asarray(rng.standard_normal((SLOTS, VOCAB)), jnp.float32)
    logits = jnp.asarray(rng.standard_normal((3, VOCAB)), jnp.bfloat16)
    conditional, masked = both_ways(monkeypatch, hold_logits, held, logits, jnp.asarray(deferred))
    assert_same(masked, conditional)
    expected = np.asarray(held).copy()
    if any(deferred):  # the step's rows, all of them, replace the first rows
        expected[:3] = np.asarray(logits.astype(jnp.float32))
    np.testing.assert_array_equal(np.asarray(conditional), expected)


def test_a_step_whose_host_decides_writes_the_state_only_when_its_carry_stage_runs():
    """The carry stage RUN is the masked form; SKIP leaves the state as it is, even with rows to write (the
    host skips it only for steps with none)."""
    rng = np.random.default_rng(3)
    state = penalty_state(rng)
    recorded = jnp.asarray(rng.random(TOKENS) < 0.6)
    args = (state, *tokens(rng), recorded, jnp.arange(SLOTS), jnp.asarray([True] + [False] * (SLOTS - 1)))
    assert_same(update_penalty_state(*args, Gate.RUN), update_penalty_state(*args))
    assert_same(update_penalty_state(*args, Gate.SKIP), state)
    held = jnp.asarray(rng.standard_normal((SLOTS, VOCAB)), jnp.float32)
    logits, deferred = jnp.asarray(rng.standard_normal((3, VOCAB)), jnp.float32), jnp.asarray([False, True, False])
    assert_same(hold_logits(held, logits, deferred, Gate.RUN), hold_logits(held, logits, deferred))
    assert_same(hold_logits(held, logits, deferred, Gate.SKIP), held)
