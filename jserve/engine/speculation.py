"""The port through which the engine speculates: all it asks of a speculative method (spec_decode's n-gram and
draft-model proposers implement it), so the scheduler and the engine loop know "extra tokens to verify" and
"the step proposes for this request", never how proposals are made.

The scheduler asks how many extra tokens a decoding request gets (its drafts, verified by the step) and how far
past its step a request's pages must reach for the step to propose its next drafts on the device; the engine
reports what each verification accepted and what the step proposed. A proposer that runs on the device (a
draft model) comes as a StepProposer: the runner passes it its parameters and paged state, the step calls it.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Protocol

import jax
import numpy as np

from jserve.attention import AttentionBackend, KVCache, ModelInput
from jserve.config import ModelConfig
from jserve.engine.request import Request


class Speculation(Protocol):
    def active(self, num_running: int) -> bool:
        """Whether a batch of this many running requests speculates at all."""

    def extra_tokens(self, request: Request, limit: int) -> np.ndarray:
        """Up to `limit` tokens for a decoding request's step to verify after its latest one (none: empty)."""

    def lookahead(self, request: Request) -> int:
        """Positions past its step a request's pages must hold for the step to propose its next drafts on the
        device (0: the step proposes nothing for it)."""

    def plan(self, sequences: list) -> list:
        """The step's scheduled sequences, with the extra tokens that do not pay for the larger step dropped;
        called once a step, when the scheduler is done with it."""

    def accepted(self, request: Request, num_extra: int, num_accepted: int) -> None:
        """The step accepted the first `num_accepted` of the request's `num_extra` extra tokens."""

    def proposed(self, request: Request, tokens: np.ndarray) -> None:
        """The step proposed these tokens to follow the request's tokens as they are now."""

    def forget(self, request: Request) -> None:
        """The request has finished."""

    # At start-up, after warm-up: what extra tokens cost.

    def steps_to_time(self, max_num_seqs: int, max_num_batched_tokens: int) -> list[tuple[int, int, bool]]:
        """The steps to time, as (tokens, extra tokens verified, the step proposes)."""

    def calibrate(self, seconds: dict[tuple[int, int, bool], float]) -> None:
        """Their measured times."""

    def summary(self) -> str:
        """The method and its calibration, for the engine's log."""


@jax.tree_util.register_dataclass
@dataclass(frozen=True)
class ProposingRows:
    """Row r proposes after the step's sequence rows[r] (-1: unused; the used rows come first), whose extra
    tokens this step, if any, are verify rows [verify_start[r], verify_start[r] + verify_count[r])."""

    rows: jax.Array  # [D] i32
    verify_start: jax.Array  # [D] i32
    verify_count: jax.Array  # [D] i32


class DeviceProposer(Protocol):
    """What the step calls of a proposer that runs inside it: hashable (a static argument of the jitted step)."""

    def extend(self, params: list[jax.Array], kv: KVCache, batch: ModelInput, attention: AttentionBackend) -> KVCache:
        """Its paged K/V of the step's tokens (the target's batch, the same pages)."""

    def propose(self, params: list[jax.Array], kv: KVCache, attention: AttentionBackend, batch: ModelInput,
                proposing: ProposingRows, next_tokens: jax.Array, verify_tokens: jax.Array,
                verify_positions: jax.Array, sampling: Any, sample: Any) -> tuple[jax.Array, KVCache]:  # fmt: skip
        """-> ([D, k] proposals for the proposing rows' next steps, its K/V)."""


@dataclass(frozen=True)
class StepProposer:
    """A device proposer with its parameters, and the model whose paged K/V it keeps beside the target's."""

    run: DeviceProposer
    params: list[jax.Array]
    model_config: ModelConfig
