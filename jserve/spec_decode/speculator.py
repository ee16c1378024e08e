"""Speculator: which requests propose drafts each step, what they propose, and how they back off.

Proposals come from an n-gram lookup on the host, or from a draft model inside the step before (which hands
them over through `proposed`; see draft_model.py).

A step that verifies drafts costs more than a plain decode (on CPU a 5-token step ~1.6-2.4x a 1-token
one), so proposing pays only while enough drafts are accepted. Each request keeps a running mean of the
tokens its verifications accepted; when it falls below the break-even (the measured cost ratio of a verify
step to a decode step without speculation, less one), the request stops proposing for a few steps, twice as
many each time it happens again (reset by a verification that pays). A lookup that finds nothing costs no
back-off: text that quotes its prompt resumes quoting after a changed word, and the next lookup should
catch it.

Contract: the only writer of its per-request records and of the engine's speculation counters.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any, Protocol

import numpy as np

from jserve.spec_decode.config import SpeculativeConfig
from jserve.spec_decode.ngram import propose_ngram

MAX_BACKOFF_STEPS = 32


# What the Speculator reads of the engine's objects, declared here so that this package needs nothing of the
# engine's (the engine passes its own Request, ScheduledSequence and EngineStats).


class Request(Protocol):
    request_id: str
    params: Any  # SamplingParams: uses_penalties, min_tokens
    grammar: Any  # a GrammarMatcher (valid_prefix), or None
    token_buffer: np.ndarray  # prompt then output tokens, num_tokens of them known
    num_tokens: int
    num_pending: int  # tokens sampled by launched steps, not fetched yet
    num_output_tokens: int


class ScheduledSequence(Protocol):  # a dataclass: dataclasses.replace makes the changed copy
    request: Request
    num_tokens: int  # the request's own tokens this step, then its drafts
    drafts: np.ndarray
    samples: bool  # the step samples the request's next token


class Counters(Protocol):
    """The engine's speculation counters (vLLM's): verifications, drafts proposed, accepted, by position."""

    spec_drafts: int
    spec_draft_tokens: int
    spec_accepted_tokens: int
    spec_accepted_per_pos: np.ndarray


@dataclass
class _Record:
    """One request's speculation so far."""

    next_step: int = 0  # it may propose again from this step on
    backoff: int = 1  # steps it waits after its next disappointment
    mean_accepted: float | None = None  # running mean of accepted drafts per verification
    guess: tuple[int, int] | None = None  # (position, token): the latest proposal's guess of a token in flight
    proposal: np.ndarray | None = None  # a draft model's latest proposal, to follow the request's first
    proposal_at: int = 0  # proposal_at tokens


class Speculator:
    def __init__(self, config: SpeculativeConfig, stats: Counters):
        self.config, self.stats = config, stats
        self.break_even = 0.0  # accepted drafts per verification below which proposing costs more than it saves
        self.step = 0
        self._records: dict[str, _Record] = {}
        self._sizes = np.zeros(0)  # step sizes (tokens) timed, ascending, and their seconds (set_step_costs)
        self._seconds = np.zeros(0)
        self._plain: float | None = None

    def steps_to_time(self, max_num_seqs: int, max_num_batched_tokens: int) -> list[tuple[int, int, bool]]:
        """The steps whose times `calibrate` takes, as (tokens, drafts verified, proposes): 1 to
        disable_by_batch_size requests, with all their drafts or none; with a draft model also a decode that
        proposes nothing (its proposals cost every step they are made in: a request that stops speculating
        saves that)."""
        k = self.config.num_speculative_tokens
        requests = range(1, min(self.config.disable_by_batch_size, max_num_seqs) + 1)
        drafts = {n: 0 for n in requests} | {n * (k + 1): n * k for n in requests}
        steps = [(n, drafts[n], True) for n in sorted(drafts) if n <= max_num_batched_tokens]
        return steps + [(1, 0, False)] if self.config.uses_draft_model else steps

    def calibrate(self, seconds: dict[tuple[int, int, bool], float]) -> None:
        """The measured times of the steps `steps_to_time` asked for."""
        costs = {num_tokens: s for (num_tokens, _, proposes), s in seconds.items() if proposes}
        self.set_step_costs(costs, seconds.get((1, 0, False)))

    def summary(self) -> str:
        """The method and what calibration found, for the engine's log."""
        spec = self.config
        proposer = (f"draft model {spec.model}" if spec.uses_draft_model
                    else f"n-grams of {spec.prompt_lookup_min}-{spec.prompt_lookup_max} tokens")  # fmt: skip
        steps = ", ".join(f"{int(n)}: {1000 * c:.1f}" for n, c in zip(self._sizes, self._seconds, strict=True))
        plain = f" (a decode without proposing: {1000 * self._plain:.1f})" if self._plain else ""
        return (f"{proposer}, {spec.num_speculative_tokens} draft tokens, up to {spec.disable_by_batch_size} running "
                f"requests; step ms by tokens: {steps}{plain}; a request keeps proposing while its verifications "
                f"accept {self.break_even:.2f} drafts on average")  # fmt: skip

    def set_step_costs(self, seconds: dict[int, float], plain_decode: float | None = None) -> None:
        """The measured time of steps of some token counts (1 to disable_by_batch_size requests, with all their
        drafts or none): what `worthwhile` weighs drafts against, interpolated between them; the break-even
        is a lone request's verify step against its decode step without speculation (`plain_decode`, when
        proposing costs the step something: a draft model's proposals; else the 1-token step)."""
        self._plain = plain_decode
        self._sizes = np.array(sorted(seconds), float)
        self._seconds = np.array([seconds[n] for n in sorted(seconds)])
        verify = self._cost(self.config.num_speculative_tokens + 1)
        self.break_even = max(0.0, verify / (plain_decode or self._cost(1)) - 1)

    def _cost(self, num_tokens: int) -> float:
        return float(np.interp(num_tokens, self._sizes, self._seconds))

    def worthwhile(self, sequences: list[ScheduledSequence]) -> list[ScheduledSequence]:
        """The step's sequences, keeping drafts only where they pay: a larger step costs more for everyone in
        it, so drafts are dropped, the least promising first, while that raises the tokens the step is
        expected to yield per second (see _expected)."""
        drafting = sorted((i for i, seq in enumerate(sequences) if len(seq.drafts)),
                          key=lambda i: self._expected(sequences[i]))  # fmt: skip
        if not drafting or not len(self._sizes):
            return sequences
        base_tokens = sum(seq.num_tokens - len(seq.drafts) for seq in sequences)
        base_yield = sum(seq.samples for seq in sequences)

        def rate(kept: list[int]) -> float:
            tokens = base_tokens + sum(len(sequences[i].drafts) for i in kept)
            return (base_yield + sum(self._expected(sequences[i]) for i in kept)) / self._cost(tokens)

        options = [drafting[start:] for start in range(len(drafting) + 1)]  # drop the least promising first
        kept = set(max(options, key=rate))
        return [seq if i in kept or not len(seq.drafts) else _without_drafts(seq) for i, seq in enumerate(sequences)]

    def _expected(self, seq: ScheduledSequence) -> float:
        """Drafts of the sequence the step is expected to accept: its running mean, or all of them while it has
        none (a request gets to show what its drafts are worth; its back-off limits what that costs)."""
        record = self._records.get(seq.request.request_id)
        mean = record.mean_accepted if record is not None else None
        return min(len(seq.drafts), mean if mean is not None else len(seq.drafts))

    @property
    def proposes_on_device(self) -> bool:
        """Proposals come from a draft model inside the step before (see `proposed`), not from a host lookup."""
        return self.config.uses_draft_model

    # --- the engine's port (engine/speculation.py) ---------------------------------------------------

    def active(self, num_running: int) -> bool:
        """Whether a batch of this many running requests speculates at all."""
        return num_running <= self.config.disable_by_batch_size

    def extra_tokens(self, request: Request, limit: int) -> np.ndarray:
        """Drafts for a decoding request's step, up to `limit` (empty while it backs off or cannot speculate)."""
        return self.propose(request, limit) if self.wants(request) else np.zeros(0, np.int32)

    def lookahead(self, request: Request) -> int:
        """With a draft model, the positions its proposals for the request's next step take (0 with n-grams,
        which propose on the host, or while the request backs off)."""
        return self.config.num_speculative_tokens if self.proposes_on_device and self.wants(request) else 0

    def plan(self, sequences: list[ScheduledSequence]) -> list[ScheduledSequence]:
        """The step's sequences with only the drafts that pay (see worthwhile); the step's clock ticks."""
        self.step += 1
        return self.worthwhile(sequences)

    def forget(self, request: Request) -> None:
        self._records.pop(request.request_id, None)

    # --- proposing and backing off ----------------------------------------------------------------------

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
        if count <= 0 or guessed > 1 or (guessed and (request.grammar is not None or self.proposes_on_device)):
            return np.zeros(0, np.int32)
        proposal = self.lookup(request, count + guessed)
        drafts = proposal[guessed:]
        if guessed and len(drafts):
            self._record(request).guess = (request.num_tokens, int(proposal[0]))
        elif request.request_id in self._records:
            self._records[request.request_id].guess = None
        if request.grammar is not None:
            drafts = drafts[: request.grammar.valid_prefix(drafts)]
        return drafts

    def lookup(self, request: Request, count: int) -> np.ndarray:
        """The method's proposal of `count` tokens (or fewer) after the request's known tokens."""
        config = self.config
        if config.uses_draft_model:
            record = self._records.get(request.request_id)
            if record is None or record.proposal is None or record.proposal_at != request.num_tokens:
                return np.zeros(0, np.int32)
            return record.proposal[:count]
        tokens = request.token_buffer[: request.num_tokens]
        return propose_ngram(tokens, config.prompt_lookup_min, config.prompt_lookup_max, count)

    def proposed(self, request: Request, proposal: np.ndarray) -> None:
        """A draft model's proposal to follow the request's tokens as they are now."""
        record = self._record(request)
        record.proposal, record.proposal_at = proposal, request.num_tokens

    def accepted(self, request: Request, num_drafts: int, num_accepted: int) -> None:
        """The target model accepted the first `num_accepted` of the request's `num_drafts` drafts."""
        stats = self.stats
        stats.spec_drafts += 1
        stats.spec_draft_tokens += num_drafts
        stats.spec_accepted_tokens += num_accepted
        stats.spec_accepted_per_pos[:num_accepted] += 1
        record = self._record(request)
        if record.guess is not None:
            (position, token), record.guess = record.guess, None
            if request.token_buffer[position] != token:
                return  # the drafts followed a wrong guess of the token in flight: no verdict on the lookup
        mean = num_accepted if record.mean_accepted is None else (record.mean_accepted + num_accepted) / 2
        record.mean_accepted = mean
        if mean < self.break_even or num_accepted == 0:
            self._back_off(record)
            record.mean_accepted = None  # it starts afresh when it proposes again
        else:
            record.backoff = 1

    def _record(self, request: Request) -> _Record:
        return self._records.setdefault(request.request_id, _Record())

    def _back_off(self, record: _Record) -> None:
        record.next_step = self.step + 1 + record.backoff
        record.backoff = min(2 * record.backoff, MAX_BACKOFF_STEPS)


def _without_drafts(seq: ScheduledSequence) -> ScheduledSequence:
    return dataclasses.replace(seq, num_tokens=seq.num_tokens - len(seq.drafts), drafts=seq.drafts[:0])
