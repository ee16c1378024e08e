"""Speculator: which requests propose drafts each step, what they propose, and how they back off.

A step that verifies drafts costs more than a plain decode (on CPU a 5-token step ~1.6-2.4x a 1-token
one), so proposing pays only while enough drafts are accepted. Each request keeps a running mean of the
tokens its verifications accepted; when it falls below the break-even (the measured cost ratio of a verify
step less one), the request stops proposing for a few steps, twice as many each time it happens again
(reset by a verification that pays). A lookup that finds nothing costs no back-off: text that quotes its
prompt resumes quoting after a changed word, and the next lookup should catch it.

Contract: the only writer of its per-request records and of the engine's speculation counters.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

import numpy as np

from jserve.spec_decode.config import SpeculativeConfig
from jserve.spec_decode.ngram import propose_ngram

if TYPE_CHECKING:
    from jserve.engine.request import Request
    from jserve.engine.stats import EngineStats

MAX_BACKOFF_STEPS = 32


@dataclass
class _Record:
    """One request's speculation so far."""

    next_step: int = 0  # it may propose again from this step on
    backoff: int = 1  # steps it waits after its next disappointment
    mean_accepted: float | None = None  # running mean of accepted drafts per verification


class Speculator:
    def __init__(self, config: SpeculativeConfig, stats: EngineStats):
        self.config, self.stats = config, stats
        self.break_even = 0.0  # accepted drafts per verification below which proposing costs more than it saves
        self.step = 0
        self._records: dict[str, _Record] = {}

    def next_step(self) -> None:
        self.step += 1

    def active(self, num_running: int) -> bool:
        """Whether a batch of this many running requests speculates at all."""
        return num_running <= self.config.disable_by_batch_size

    def wants(self, request: Request) -> bool:
        """Whether the request would propose this step: its options allow it and it is not backing off."""
        params = request.params
        if params.uses_penalties:
            return False  # the token counts they read would count rejected drafts
        if request.num_output_tokens < params.min_tokens:
            return False  # a stop id is suppressed at some positions and not at others
        record = self._records.get(request.request_id)
        return record is None or self.step >= record.next_step

    def propose(self, request: Request, limit: int) -> np.ndarray:
        """Up to `limit` draft tokens to follow the request's latest token (empty: none found); with a
        grammar, only as many as it allows.

        With async scheduling the latest token may still be in flight (its step not fetched): the lookup
        then proposes one token more after the known ones, and the first, its guess of the token in flight,
        is dropped. A wrong guess costs only acceptance: each draft is checked against what the model samples
        after the actual tokens."""
        count = min(self.config.num_speculative_tokens, limit)
        guessed = request.num_pending  # 0 or 1 (a step in flight)
        if count <= 0 or guessed > 1 or (guessed and request.grammar is not None):
            return np.zeros(0, np.int32)
        drafts = self.lookup(request, count + guessed)[guessed:]
        if request.grammar is not None:
            drafts = drafts[: request.grammar.valid_prefix(drafts)]
        return drafts

    def lookup(self, request: Request, count: int) -> np.ndarray:
        """The method's proposal of `count` tokens (or fewer) after the request's known tokens."""
        config = self.config
        tokens = request.token_buffer[: request.num_tokens]
        return propose_ngram(tokens, config.prompt_lookup_min, config.prompt_lookup_max, count)

    def verified(self, request: Request, num_drafts: int, num_accepted: int) -> None:
        """The target model accepted the first `num_accepted` of the request's `num_drafts` drafts."""
        stats = self.stats
        stats.spec_drafts += 1
        stats.spec_draft_tokens += num_drafts
        stats.spec_accepted_tokens += num_accepted
        stats.spec_accepted_per_pos[:num_accepted] += 1
        record = self._record(request)
        mean = num_accepted if record.mean_accepted is None else (record.mean_accepted + num_accepted) / 2
        record.mean_accepted = mean
        if mean < self.break_even or num_accepted == 0:
            self._back_off(record)
            record.mean_accepted = None  # it starts afresh when it proposes again
        else:
            record.backoff = 1

    def forget(self, request: Request) -> None:
        self._records.pop(request.request_id, None)

    def _record(self, request: Request) -> _Record:
        return self._records.setdefault(request.request_id, _Record())

    def _back_off(self, record: _Record) -> None:
        record.next_step = self.step + 1 + record.backoff
        record.backoff = min(2 * record.backoff, MAX_BACKOFF_STEPS)
