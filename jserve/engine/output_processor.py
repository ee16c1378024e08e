"""After each step: append sampled tokens, detokenize incrementally, decide which requests stop and why, and
hand each step's new text and tokens out as a CompletionOutput's deltas.

Contract: the OutputProcessor is the only writer of a request's sampled tokens, from launch to fetch
(num_pending, pending_row, then token_buffer and num_tokens) and their logprobs.
"""

from __future__ import annotations

from dataclasses import dataclass, field, replace
from time import perf_counter

import numpy as np

from jserve.engine.prompt_logprobs import PromptScores
from jserve.engine.request import Request, RequestStatus
from jserve.engine.sampler import TOP_IDS, TOP_LOGPROBS
from jserve.outputs import CompletionOutput, Logprob
from jserve.tokenizer import IncrementalDetokenizer, Tokenizer, incremental_detokenizer


@dataclass(slots=True)
class CompletionState:
    """What of a request's completion its outputs have carried, and what waits for the next one."""

    detokenizer: IncrementalDetokenizer
    # The ids that end it (its stop_token_ids, and EOS unless ignore_eos), worked out once, which count
    # from its stop_from-th token on (min_tokens).
    stop_ids: frozenset[int]
    stop_from: int
    max_stop_len: int = 0
    # Decoded text no output has carried yet: while the request runs, its last max_stop_len - 1 characters
    # stay here (they could still begin a stop string), so it holds that tail plus the text of the steps
    # since the last output.
    unsent: str = ""
    sent: list[str] = field(default_factory=list)  # the deltas carried so far, joined once it finishes
    unsent_ids: list[int] = field(default_factory=list)  # output tokens no output has carried yet
    logprobs_sent: int = 0  # logprob entries carried so far (with logprobs)
    final: CompletionOutput | None = None  # once its finished output is made: what later outputs repeat
    prompt_logprobs: list | None = None  # built once the whole prompt is scored


class FetchedSamples:
    """A fetched step's samples (packed rows: sampler.pack_samples), their ids (and, once a row asks, their
    logprobs) as Python lists: converted once per step, since reading one numpy element per row costs more
    than the whole conversion."""

    __slots__ = ("ids", "token_ids", "_packed", "_logprobs")

    def __init__(self, packed: np.ndarray):
        self.ids = packed[:, 0]  # [S] int32
        self.token_ids: list[int] = self.ids.tolist()
        self._packed = packed
        self._logprobs: list[float] | None = None

    @property
    def logprobs(self) -> list[float]:
        """Each row's sampled token's logprob (only requests that asked for logprobs read them)."""
        if self._logprobs is None:
            self._logprobs = self._packed[:, 1].view(np.float32).tolist()
        return self._logprobs

    @property
    def top_ids(self) -> np.ndarray:
        return self._packed[:, TOP_IDS]  # [S, MAX_LOGPROBS] int32, -1 past the vocabulary

    @property
    def top_logprobs(self) -> np.ndarray:
        return self._packed[:, TOP_LOGPROBS].view(np.float32)


class OutputProcessor:
    def __init__(self, tokenizer: Tokenizer, eos_ids: frozenset[int]):
        self.tokenizer = tokenizer
        self.eos_ids = tuple(eos_ids)
        self.states: dict[str, CompletionState] = {}
        self.detokenize_s = 0.0  # host time decoding text, for the engine's stats
        tokenizer.byte_piece_texts()  # built now (passes over the vocabulary), not on the first request

    def register(self, request: Request) -> None:
        params = request.params
        detokenizer = incremental_detokenizer(self.tokenizer, request.prompt_token_ids, params.skip_special_tokens)
        self.states[request.request_id] = CompletionState(
            detokenizer, frozenset(params.stop_ids(self.eos_ids)), request.num_prompt_tokens + params.min_tokens,
            max(map(len, params.stop), default=0),
        )  # fmt: skip

    def forget(self, request: Request) -> None:
        self.states.pop(request.request_id, None)

    def launched(self, request: Request, row: int) -> None:
        """A launched step samples the request's next token into `row` of its samples: pending until fetched."""
        request.num_pending += 1
        request.pending_row = row

    def append(self, request: Request, samples: FetchedSamples, row: int) -> tuple[str, int | str | None] | None:
        """Add row's token to the request: its oldest pending one, or one more its step gained by verifying
        drafts (the step launched with one pending); returns (finish_reason, stop_reason) if it ends the
        request."""
        token = samples.token_ids[row]
        if request.num_pending:
            request.num_pending -= 1
        request.append_token(token)
        if request.grammar is not None:
            request.grammar.accept(token)
        if request.params.logprobs is not None:  # (cumulative_logprob is reported with logprobs only)
            request.cumulative_logprob += samples.logprobs[row]
            request.logprobs.append(self._logprobs(token, samples, row, request.params.logprobs))
        state = self.states[request.request_id]
        state.unsent_ids.append(token)
        start = perf_counter()
        delta = state.detokenizer.add(token)
        self.detokenize_s += perf_counter() - start
        state.unsent += delta
        finish = self._check_stop(request, token, state, len(delta))
        if finish is not None and not isinstance(finish[1], str):
            state.unsent += state.detokenizer.flush()  # bytes held back for a character that never completed
        return finish

    def record_prompt_scores(self, request: Request, scores: PromptScores, offset: int, start: int, count: int) -> None:
        """Keep the scores of a chunk of the prompt (positions start.. start + count, at offset in the step's
        tokens). A chunk computed again after preemption is not recorded twice."""
        stop = min(start + count, request.num_prompt_tokens - 1)  # the last prompt token has no successor here
        first = max(start, request.num_prompt_scored)
        if stop <= first:
            return
        rows = slice(offset + first - start, offset + stop - start)
        request.prompt_scores.append(
            (scores.logprob[rows], scores.rank[rows], scores.top_ids[rows], scores.top_logprobs[rows])
        )
        request.num_prompt_scored = stop

    def prompt_logprobs(self, request: Request) -> list[dict[int, Logprob] | None] | None:
        """vLLM's prompt_logprobs of the request, once its whole prompt is scored (None before, and without)."""
        top_n = request.params.prompt_logprobs
        state = self.states.get(request.request_id)
        if top_n is None or state is None or request.num_prompt_scored < request.num_prompt_tokens - 1:
            return None
        if state.prompt_logprobs is None:
            entries: list[dict[int, Logprob] | None] = [None]
            targets = request.prompt_token_ids[1:]
            columns = [np.concatenate(parts) for parts in zip(*request.prompt_scores, strict=True)] if targets else []
            for i, target in enumerate(targets):
                logprob, rank, top_ids, top_logprobs = (column[i] for column in columns)
                entries.append(self._entry(target, float(logprob), int(rank), top_ids, top_logprobs, top_n))
            state.prompt_logprobs = entries
        return state.prompt_logprobs

    def completion(self, request: Request) -> CompletionOutput:
        """The request's output for this step: what it adds since the last one and, once the request has
        finished, the whole completion."""
        state = self.states[request.request_id]
        if state.final is not None:  # finished and output already: a sibling's progress asks again
            return state.final
        finished = request.status is RequestStatus.FINISHED
        held = 0 if finished else state.max_stop_len - 1
        if held > 0:
            cut = max(0, len(state.unsent) - held)
            delta, state.unsent = state.unsent[:cut], state.unsent[cut:]
        else:
            delta, state.unsent = state.unsent, ""
        if delta:
            state.sent.append(delta)
        wants_logprobs = request.params.logprobs is not None
        delta_logprobs = None
        if wants_logprobs:
            delta_logprobs = request.logprobs[state.logprobs_sent :]
            state.logprobs_sent = len(request.logprobs)
        delta_ids, state.unsent_ids = state.unsent_ids, []
        if finished:  # the whole completion, assembled once
            text, token_ids, logprobs = "".join(state.sent), request.output_token_ids, list(request.logprobs)
        else:
            text, token_ids, logprobs = "", [], []
        # (positional: one output per request per step, and a keyword call costs about twice as much)
        out = CompletionOutput(
            request.index, text, token_ids, request.cumulative_logprob if wants_logprobs else None,
            logprobs if wants_logprobs else None, request.finish_reason, request.stop_reason, delta, delta_ids,
            delta_logprobs,
        )  # fmt: skip
        if finished:
            state.final = replace(out, delta="", delta_token_ids=[], delta_logprobs=[] if wants_logprobs else None)
        return out

    def _check_stop(
        self, request: Request, token: int, state: CompletionState, delta_len: int
    ) -> tuple[str, int | str | None] | None:
        num_tokens = request.num_tokens
        if num_tokens >= state.stop_from:
            if token in state.stop_ids:
                return "stop", token if token in request.params.stop_token_ids else None
            if state.max_stop_len:
                # Only the tail the last token could have completed needs searching, and it is all unsent.
                tail_start = max(0, len(state.unsent) - delta_len - state.max_stop_len + 1)
                for stop in request.params.stop:
                    at = state.unsent.find(stop, tail_start)
                    if at >= 0:
                        state.unsent = state.unsent[:at]
                        return "stop", stop
        if request.grammar is not None and request.grammar.terminated:  # the output is complete
            return "stop", None
        if num_tokens >= request.max_len:  # max_tokens, or the context
            return "length", None
        return None

    def _logprobs(self, token: int, samples: FetchedSamples, row: int, top_n: int) -> dict[int, Logprob]:
        top_ids, top_lps = samples.top_ids[row], samples.top_logprobs[row]
        ranks = np.flatnonzero(top_ids == token)
        rank = int(ranks[0]) + 1 if len(ranks) else None  # known when the token is among the top ones
        return self._entry(token, samples.logprobs[row], rank, top_ids, top_lps, top_n)

    def _entry(
        self, token: int, logprob: float, rank: int | None, top_ids: np.ndarray, top_lps: np.ndarray, top_n: int
    ) -> dict[int, Logprob]:
        """A token's logprob entry: the token itself, then the top_n most likely, with their decoded text."""
        entry = {token: Logprob(logprob, rank)}
        for rank, (tid, lp) in enumerate(zip(top_ids[:top_n].tolist(), top_lps[:top_n].tolist(), strict=True), 1):
            entry.setdefault(tid, Logprob(lp, rank))
        for tid, lp in entry.items():
            lp.decoded_token = self.tokenizer.decode([tid], skip_special_tokens=False)
        return entry
