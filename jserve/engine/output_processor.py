"""After each step: append sampled tokens, detokenize incrementally, and decide which requests stop and why.

Contract: the OutputProcessor is the only writer of a request's sampled tokens, from launch to fetch
(num_pending, pending_row, then token_buffer and num_tokens) and their logprobs.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from jserve.engine.request import Request
from jserve.engine.sampler import SamplerOutput
from jserve.outputs import Logprob
from jserve.tokenizer import IncrementalDetokenizer, Tokenizer


@dataclass
class TextState:
    detokenizer: IncrementalDetokenizer
    text: str = ""
    max_stop_len: int = 0

    def visible_text(self, finished: bool) -> str:
        """The text so far, holding back a tail that could still grow into a stop string."""
        if finished or self.max_stop_len <= 1:
            return self.text
        return self.text[: max(0, len(self.text) - (self.max_stop_len - 1))]


class OutputProcessor:
    def __init__(self, tokenizer: Tokenizer, eos_ids: frozenset[int]):
        self.tokenizer = tokenizer
        self.eos_ids = eos_ids
        self.texts: dict[str, TextState] = {}

    def register(self, request: Request) -> None:
        params = request.params
        detokenizer = IncrementalDetokenizer(self.tokenizer, request.prompt_token_ids, params.skip_special_tokens)
        self.texts[request.request_id] = TextState(detokenizer, max_stop_len=max(map(len, params.stop), default=0))

    def forget(self, request: Request) -> None:
        self.texts.pop(request.request_id, None)

    def launched(self, request: Request, row: int) -> None:
        """A launched step samples the request's next token into `row` of its samples: pending until fetched."""
        request.num_pending += 1
        request.pending_row = row

    def append(self, request: Request, samples: SamplerOutput, row: int) -> tuple[str, int | str | None] | None:
        """Add row's token (the oldest pending one) to the request; returns (finish_reason, stop_reason) if it
        ends the request."""
        token = int(samples.token_ids[row])
        request.num_pending -= 1
        request.append_token(token)
        request.cumulative_logprob += float(samples.logprobs[row])
        if request.params.logprobs is not None:
            request.logprobs.append(self._logprobs(token, samples, row, request.params.logprobs))
        state = self.texts[request.request_id]
        delta = state.detokenizer.add([token])
        state.text += delta
        finish = self._check_stop(request, token, state, len(delta))
        if finish is not None and not isinstance(finish[1], str):
            state.text += state.detokenizer.flush()  # bytes held back for a character that never completed
        return finish

    def _check_stop(
        self, request: Request, token: int, state: TextState, delta_len: int
    ) -> tuple[str, int | str | None] | None:
        params = request.params
        if request.num_output_tokens >= params.min_tokens:
            if token in params.stop_token_ids:
                return "stop", token
            if not params.ignore_eos and token in self.eos_ids:
                return "stop", None
            if params.stop:
                # Only the tail the last token could have completed needs searching.
                tail_start = max(0, len(state.text) - delta_len - state.max_stop_len + 1)
                for stop in params.stop:
                    at = state.text.find(stop, tail_start)
                    if at >= 0:
                        state.text = state.text[:at]
                        return "stop", stop
        if params.max_tokens is not None and request.num_output_tokens >= params.max_tokens:
            return "length", None
        if request.num_tokens >= request.max_model_len:
            return "length", None
        return None

    def _logprobs(self, token: int, samples: SamplerOutput, row: int, top_n: int) -> dict[int, Logprob]:
        top_ids, top_lps = samples.top_ids[row], samples.top_logprobs[row]
        ranks = np.flatnonzero(top_ids == token)
        entry = {token: Logprob(float(samples.logprobs[row]), int(ranks[0]) + 1 if len(ranks) else None)}
        for rank, (tid, lp) in enumerate(zip(top_ids[:top_n].tolist(), top_lps[:top_n].tolist(), strict=True), 1):
            entry.setdefault(tid, Logprob(lp, rank))
        for tid, lp in entry.items():
            lp.decoded_token = self.tokenizer.decode([tid], skip_special_tokens=False)
        return entry
