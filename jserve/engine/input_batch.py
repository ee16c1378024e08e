"""The persistent batch: per-slot host arrays of what running requests bring to a step, and each step's inputs
gathered from them.

A request's options (sampling, penalties, seed, bias, grammar, prompt scoring) and its page-table row are
written into its slot's rows when it joins (admission gives it a slot and a new admission index) or when its
pages change (KVManager replaces `Request.pages`, never edits it in place, so an identity check finds it).
A step then reads one pass of per-sequence numbers (slot, start, tokens) and gathers the rest by slot with
vectorised numpy: no per-sequence Python beyond that pass. Options live in a few [slots + 1, k] tables, so
one gather reads all of a table's columns for every row (each numpy call costs microseconds whatever its
size); their last row holds what padding rows take.
"""

from __future__ import annotations

import jax
import numpy as np

from jserve.attention import ModelInput
from jserve.attention.metadata import ragged_model_input
from jserve.engine.request import Request
from jserve.engine.sampler import BIAS_WIDTH, PADDING, SamplingBatch, bias_entries
from jserve.engine.step import PenaltyUpdate

NO_PAGES = np.zeros(0, np.int32)

# The sampling options of a row, by table column (seeds: the uint32's bits in an int32 column).
FLOAT_OPTIONS = ("temperature", "top_p", "min_p", "repetition_penalty", "presence_penalty", "frequency_penalty")
INT_OPTIONS = ("top_k", "seeds", "wants_top_logprobs")
# What the host's own arithmetic reads of a row, by column of the facts table.
PROMPT_LEN, MIN_TOKENS, HAS_BIAS, HAS_GRAMMAR, SCORES_PROMPT, USES_PENALTIES = range(6)


def padded(values: np.ndarray, length: int, dtype=None) -> np.ndarray:
    """values followed by zeros (False), `length` long."""
    out = np.zeros(length, dtype or values.dtype)
    out[: len(values)] = values
    return out


class InputBatch:
    def __init__(self, num_slots: int, max_pages: int, page_size: int, stop_ids: frozenset[int]):
        self.page_size, self.stop_ids = page_size, tuple(stop_ids)
        self.padding_row = num_slots  # the row of every table that padding rows gather
        self.owner = np.full(num_slots, -1, np.int64)  # admit_index of the request whose options fill the row
        self.float_options = np.array([[PADDING[name] for name in FLOAT_OPTIONS]] * (num_slots + 1), np.float32)
        self.int_options = np.array([[PADDING[name] for name in INT_OPTIONS]] * (num_slots + 1), np.int32)
        self.facts = np.zeros((num_slots + 1, 6), np.int32)
        # The row's logit bias, and the one while min_tokens is unmet (its EOS and stop ids forbidden too).
        self.bias_ids = np.full((num_slots, BIAS_WIDTH), -1, np.int32)
        self.bias_values = np.zeros((num_slots, BIAS_WIDTH), np.float32)
        self.early_bias_ids = np.full((num_slots, BIAS_WIDTH), -1, np.int32)
        self.early_bias_values = np.zeros((num_slots, BIAS_WIDTH), np.float32)
        self.page_table = np.zeros((num_slots + 1, max_pages), np.int32)  # (the padding row stays zero)
        self.adapter_slot = np.full(num_slots, -1, np.int32)  # the LoRA adapter slot the row's request reads
        self.pages: list[np.ndarray] = [NO_PAGES] * num_slots  # the Request.pages each page-table row copies
        self._constants: dict = {}  # inputs of features no row of a step uses, by (feature, bucket): see constant

    def join(self, slot: int, request: Request) -> None:
        """Write a newly admitted request's options into its slot's rows."""
        params = request.params
        self.owner[slot] = request.admit_index
        self.adapter_slot[slot] = request.adapter_slot
        self.float_options[slot] = (params.temperature, params.top_p, params.min_p, params.repetition_penalty,
                                    params.presence_penalty, params.frequency_penalty)  # fmt: skip
        seed = np.uint32(request.seed % 2**32).view(np.int32)
        self.int_options[slot] = (params.top_k, seed, params.logprobs is not None)
        suppressed = params.stop_ids(self.stop_ids)
        plain, early = bias_entries(params), bias_entries(params, suppressed if params.min_tokens else ())
        self.facts[slot] = (request.num_prompt_tokens, params.min_tokens, bool(plain) or bool(early),
                            request.grammar is not None, params.prompt_logprobs is not None,
                            params.uses_penalties)  # fmt: skip
        for ids, values, entries in ((self.bias_ids, self.bias_values, plain),
                                     (self.early_bias_ids, self.early_bias_values, early)):  # fmt: skip
            ids[slot], values[slot] = -1, 0.0
            ids[slot, : len(entries)] = list(entries)
            values[slot, : len(entries)] = list(entries.values())

    def constant(self, key, make):
        """What a step passes when no row uses a feature, made once per `key` (the feature and the step's shape)
        and read-only from then on: steps share it, and the device may still read an earlier step's."""
        if (value := self._constants.get(key)) is None:
            value = self._constants[key] = make()
            for array in jax.tree.leaves(value):
                array.flags.writeable = False
        return value

    def set_pages(self, slot: int, pages: np.ndarray) -> None:
        self.page_table[slot, : len(pages)] = pages
        self.pages[slot] = pages

    def rows(self, slots: np.ndarray, num_seqs: int) -> np.ndarray:
        """The table rows of a step's `num_seqs` sequence rows: each sequence's slot, then the padding row."""
        rows = np.full(num_seqs, self.padding_row, np.intp)
        rows[: len(slots)] = slots
        return rows

    def model_input(self, rows, starts, lens, token_ids, num_tokens: int) -> ModelInput:
        """The step's padded ragged batch: `lens[i]` tokens of the sequence in `rows[i]` from `starts[i]`."""
        page_tables = self.page_table[rows]
        return ragged_model_input(token_ids, starts, lens, page_tables, self.page_size, num_tokens, len(rows))

    def adapter_slots(self, slots: np.ndarray, lens: np.ndarray, num_tokens: int) -> np.ndarray:
        """Each of the step's tokens' adapter slot (-1: none, as for padding)."""
        per_sequence = self.adapter_slot[slots]
        if not (per_sequence >= 0).any():
            return self.constant(("no adapters", num_tokens), lambda: np.full(num_tokens, -1, np.int32))
        out = np.full(num_tokens, -1, np.int32)
        out[: int(lens.sum())] = np.repeat(per_sequence, lens)
        return out

    def sampling(self, rows, facts, padded_slots, num_output, constrained, bitmask, no_bias) -> SamplingBatch:
        """The step's sampling rows: each sequence's options gathered from its slot, padding rows greedy with
        every option off. `facts`: the sequences' rows of the facts table; `padded_slots`: their slots, then zeros;
        `num_output`: tokens generated before the row's sample; `constrained`: [num_seqs] whether the row's mask
        comes with the step; `no_bias`: the (ids, values) to pass when no row has a bias (kept on the device by
        the runner)."""
        n, num_seqs = len(facts), len(rows)
        floats, ints = self.float_options[rows], self.int_options[rows]
        if facts[:, HAS_BIAS].any():
            slots = rows[:n]
            early = (num_output < facts[:, MIN_TOKENS])[:, None]
            bias_ids = np.full((num_seqs, BIAS_WIDTH), PADDING["bias_ids"], np.int32)
            bias_values = np.full((num_seqs, BIAS_WIDTH), PADDING["bias_values"], np.float32)
            bias_ids[:n] = np.where(early, self.early_bias_ids[slots], self.bias_ids[slots])
            bias_values[:n] = np.where(early, self.early_bias_values[slots], self.bias_values[slots])
        else:
            bias_ids, bias_values = no_bias
        temperature, top_p, min_p, repetition, presence, frequency = floats.T
        return SamplingBatch(
            temperature=temperature,
            top_k=ints[:, 0],
            top_p=top_p,
            min_p=min_p,
            repetition_penalty=repetition,
            presence_penalty=presence,
            frequency_penalty=frequency,
            seeds=ints[:, 1].view(np.uint32),
            steps=padded(num_output, num_seqs, np.int32),
            slots=padded_slots,
            bias_ids=bias_ids,
            bias_values=bias_values,
            wants_top_logprobs=ints[:, 2] != 0,
            token_bitmask=bitmask,
            constrained=constrained,
        )

    def penalties(self, padded_slots, facts, first, positions: np.ndarray, lens, num_tokens: int) -> PenaltyUpdate:
        """Only requests with penalties read their token history, so only theirs is recorded (a step of others
        skips the [S, V] update on device); it starts afresh with their first chunk."""
        tracked = facts[:, USES_PENALTIES] != 0
        num_seqs = len(padded_slots)
        if not tracked.any():  # nothing recorded or reset: the step's rows are not read
            return self.constant(("no penalties", num_tokens, num_seqs), lambda: PenaltyUpdate(
                np.zeros(num_tokens, np.int32), np.zeros(num_tokens, bool), np.zeros(num_tokens, bool),
                np.zeros(num_seqs, np.int32), np.zeros(num_seqs, bool),
            ))  # fmt: skip
        n, total = len(facts), int(lens.sum())
        token_slots = np.zeros(num_tokens, np.int32)
        token_slots[:total] = np.repeat(padded_slots[:n], lens)
        is_output = np.zeros(num_tokens, bool)
        is_output[:total] = positions[:total] >= np.repeat(facts[:, PROMPT_LEN], lens)
        recorded = np.zeros(num_tokens, bool)
        recorded[:total] = np.repeat(tracked, lens)
        return PenaltyUpdate(token_slots, is_output, recorded, padded_slots, padded(tracked & first, num_seqs, bool))
