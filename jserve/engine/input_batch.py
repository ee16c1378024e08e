"""The persistent batch: per-slot host arrays of what running requests bring to a step, and each step's inputs
gathered from them.

A request's options (sampling, penalties, seed, bias, grammar, prompt scoring) and its page-table row are
written into its slot's rows when it joins (admission gives it a slot and a new admission index) or when its
pages change (KVManager replaces `Request.pages`, never edits it in place, so an identity check finds it).
A step then reads one pass of per-sequence numbers (slot, start, tokens) and gathers the rest by slot with
vectorised numpy: no per-sequence Python beyond that pass.
"""

from __future__ import annotations

import numpy as np

from jserve.attention import ModelInput
from jserve.attention.metadata import ragged_model_input
from jserve.engine.request import Request
from jserve.engine.sampler import BIAS_WIDTH, PADDING, SamplingBatch, bias_entries
from jserve.engine.step import PenaltyUpdate

NO_PAGES = np.zeros(0, np.int32)


def padded(values: np.ndarray, length: int, dtype=None) -> np.ndarray:
    """values followed by zeros (False), `length` long."""
    out = np.zeros(length, dtype or values.dtype)
    out[: len(values)] = values
    return out


class InputBatch:
    def __init__(self, num_slots: int, max_pages: int, page_size: int, stop_ids: frozenset[int]):
        self.page_size, self.stop_ids = page_size, tuple(stop_ids)
        self.owner = np.full(num_slots, -1, np.int64)  # admit_index of the request whose options fill the row
        self.temperature = np.zeros(num_slots, np.float32)
        self.top_k = np.zeros(num_slots, np.int32)
        self.top_p = np.ones(num_slots, np.float32)
        self.min_p = np.zeros(num_slots, np.float32)
        self.repetition_penalty = np.ones(num_slots, np.float32)
        self.presence_penalty = np.zeros(num_slots, np.float32)
        self.frequency_penalty = np.zeros(num_slots, np.float32)
        self.seed = np.zeros(num_slots, np.uint32)
        self.prompt_len = np.zeros(num_slots, np.int32)
        self.min_tokens = np.zeros(num_slots, np.int32)
        self.wants_logprobs = np.zeros(num_slots, bool)
        self.uses_penalties = np.zeros(num_slots, bool)
        self.has_grammar = np.zeros(num_slots, bool)
        self.scores_prompt = np.zeros(num_slots, bool)
        # The row's logit bias, and the one while min_tokens is unmet (its EOS and stop ids forbidden too).
        self.has_bias = np.zeros(num_slots, bool)
        self.bias_ids = np.full((num_slots, BIAS_WIDTH), -1, np.int32)
        self.bias_values = np.zeros((num_slots, BIAS_WIDTH), np.float32)
        self.early_bias_ids = np.full((num_slots, BIAS_WIDTH), -1, np.int32)
        self.early_bias_values = np.zeros((num_slots, BIAS_WIDTH), np.float32)
        self.page_table = np.zeros((num_slots, max_pages), np.int32)
        self.pages: list[np.ndarray] = [NO_PAGES] * num_slots  # the Request.pages each page-table row copies

    def join(self, slot: int, request: Request) -> None:
        """Write a newly admitted request's options into its slot's rows."""
        params = request.params
        self.owner[slot] = request.admit_index
        self.temperature[slot], self.top_k[slot], self.top_p[slot] = params.temperature, params.top_k, params.top_p
        self.min_p[slot], self.repetition_penalty[slot] = params.min_p, params.repetition_penalty
        self.presence_penalty[slot], self.frequency_penalty[slot] = params.presence_penalty, params.frequency_penalty
        self.seed[slot] = request.seed % 2**32
        self.prompt_len[slot], self.min_tokens[slot] = request.num_prompt_tokens, params.min_tokens
        self.wants_logprobs[slot] = params.logprobs is not None
        self.uses_penalties[slot] = params.uses_penalties
        self.has_grammar[slot] = request.grammar is not None
        self.scores_prompt[slot] = params.prompt_logprobs is not None
        suppressed = params.stop_ids(self.stop_ids)
        plain, early = bias_entries(params), bias_entries(params, suppressed if params.min_tokens else ())
        self.has_bias[slot] = bool(plain) or bool(early)
        for ids, values, entries in ((self.bias_ids, self.bias_values, plain),
                                     (self.early_bias_ids, self.early_bias_values, early)):  # fmt: skip
            ids[slot], values[slot] = -1, 0.0
            ids[slot, : len(entries)] = list(entries)
            values[slot, : len(entries)] = list(entries.values())

    def set_pages(self, slot: int, pages: np.ndarray) -> None:
        self.page_table[slot, : len(pages)] = pages
        self.pages[slot] = pages

    def model_input(self, slots, starts, lens, token_ids, num_tokens: int, num_seqs: int) -> ModelInput:
        """The step's padded ragged batch: `lens[i]` tokens of the sequence in `slots[i]` from `starts[i]`."""
        page_tables = np.zeros((num_seqs, self.page_table.shape[1]), np.int32)
        page_tables[: len(slots)] = self.page_table[slots]
        return ragged_model_input(token_ids, starts, lens, page_tables, self.page_size, num_tokens, num_seqs)

    def sampling(self, slots, num_output, constrained, num_seqs: int, bitmask, no_bias) -> SamplingBatch:
        """The step's sampling rows: each sequence's options gathered from its slot, padding rows greedy with
        every option off. `num_output`: tokens generated before the row's sample; `no_bias`: the (ids, values)
        to pass when no row has a bias (kept on the device by the runner)."""
        n = len(slots)

        def column(table: np.ndarray, name: str) -> np.ndarray:
            out = np.full(num_seqs, PADDING[name], table.dtype)
            out[:n] = table[slots]
            return out

        early = num_output < self.min_tokens[slots]
        if self.has_bias[slots].any():
            bias_ids, bias_values = (
                np.full((num_seqs, BIAS_WIDTH), PADDING["bias_ids"], np.int32),
                np.full((num_seqs, BIAS_WIDTH), PADDING["bias_values"], np.float32),
            )
            bias_ids[:n] = np.where(early[:, None], self.early_bias_ids[slots], self.bias_ids[slots])
            bias_values[:n] = np.where(early[:, None], self.early_bias_values[slots], self.bias_values[slots])
        else:
            bias_ids, bias_values = no_bias
        return SamplingBatch(
            temperature=column(self.temperature, "temperature"),
            top_k=column(self.top_k, "top_k"),
            top_p=column(self.top_p, "top_p"),
            min_p=column(self.min_p, "min_p"),
            repetition_penalty=column(self.repetition_penalty, "repetition_penalty"),
            presence_penalty=column(self.presence_penalty, "presence_penalty"),
            frequency_penalty=column(self.frequency_penalty, "frequency_penalty"),
            seeds=column(self.seed, "seeds"),
            steps=padded(num_output, num_seqs, np.int32),
            slots=padded(slots, num_seqs, np.int32),
            bias_ids=bias_ids,
            bias_values=bias_values,
            wants_top_logprobs=column(self.wants_logprobs, "wants_top_logprobs"),
            token_bitmask=bitmask,
            constrained=padded(constrained, num_seqs, bool),
        )

    def penalties(self, slots, first, positions: np.ndarray, lens, num_tokens: int, num_seqs: int) -> PenaltyUpdate:
        """Only requests with penalties read their token history, so only theirs is recorded (a step of others
        skips the [S, V] update on device); it starts afresh with their first chunk."""
        n = len(slots)
        seq_of_token = np.repeat(np.arange(n), lens)
        total = len(seq_of_token)
        token_slots = np.zeros(num_tokens, np.int32)
        token_slots[:total] = slots[seq_of_token]
        tracked = self.uses_penalties[slots]
        is_output = np.zeros(num_tokens, bool)
        recorded = np.zeros(num_tokens, bool)
        if tracked.any():
            is_output[:total] = positions[:total] >= self.prompt_len[slots][seq_of_token]
            recorded[:total] = tracked[seq_of_token]
        return PenaltyUpdate(token_slots, is_output, recorded, padded(slots, num_seqs, np.int32),
                             padded(tracked & first, num_seqs, bool))  # fmt: skip
