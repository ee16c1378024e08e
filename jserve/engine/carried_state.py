"""Updating the state a step carries to the next (donated, written in place) only when a step has something
to write.

A `lax.cond` that returns either the updated state or the state untouched lets XLA:CPU skip the update's work
at run time, but XLA:GPU copies a donated buffer that leaves a conditional, every step, whichever branch ran:
its output may be the parameter's buffer or another, so the compiler copies it into the aliased output
(`benchmarks/compiled_step.py` found 164–295 MB of penalty state and held logits copied per step of an
8B model). On a GPU the update therefore runs unconditionally, in a form that leaves the state as it is when there
is nothing to write: a scatter whose masked-out rows fall outside the array and are dropped, which costs a
GPU a few microseconds. Where the host decides a step's stages (stages.py: GPUs), a step with nothing to write
leaves the update out altogether.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import TypeVar

import jax

from jserve.engine.stages import Gate

State = TypeVar("State")


def update_if(
    pred: jax.Array,
    update: Callable[[State], State],
    state: State,
    masked: Callable[[State], State] | None = None,
    gate: Gate = Gate.WHEN_NEEDED,
) -> State:
    """update(state) where `pred`, else state. GPUs run `masked` (default: `update`) instead, whatever pred is:
    it must give update's result where pred holds and leave the state unchanged where it does not. `gate`
    (the step's `carry` stage): SKIP leaves the state as it is, RUN runs `masked`."""
    masked = masked or update
    if gate is Gate.SKIP:
        return state
    if gate is Gate.RUN:
        return masked(state)

    def branch(state: State) -> State:
        return jax.lax.cond(pred, update, lambda unchanged: unchanged, state)

    return jax.lax.platform_dependent(state, cuda=masked, rocm=masked, default=branch)
