"""Sampling rows packed into a SamplingBatch one by one, for the sampler's tests (the engine gathers its rows
from the persistent batch, engine/input_batch.py)."""

from dataclasses import dataclass

import numpy as np

from jserve.engine.sampler import BIAS_WIDTH, SamplingBatch, bias_entries
from jserve.sampling_params import SamplingParams


@dataclass
class SamplingRow:
    """One sequence's sampling this step."""

    params: SamplingParams
    seed: int  # the engine derives one when params.seed is None; taken modulo 2**32
    step: int  # tokens generated so far
    slot: int
    suppressed_ids: tuple[int, ...] = ()  # ids forbidden this step (EOS/stop ids while min_tokens is unmet)
    constrained: bool = False  # a grammar's bitmask limits the row's tokens


def build_sampling_batch(rows: list[SamplingRow], num_seqs: int, token_bitmask: np.ndarray) -> SamplingBatch:
    """Packs rows into a SamplingBatch of num_seqs rows (numpy). Padding rows are greedy with every
    option off, so they cost nothing and stay finite; their tokens are to be ignored. The token bitmask
    ([num_seqs, words]) comes filled by the caller for the rows marked constrained, all ones elsewhere."""
    if len(rows) > num_seqs:
        raise ValueError(f"{len(rows)} sequences exceed the batch of {num_seqs}")

    def column(get, pad, dtype) -> np.ndarray:
        return np.array([get(r) for r in rows] + [pad] * (num_seqs - len(rows)), dtype)

    bias_ids = np.full((num_seqs, BIAS_WIDTH), -1, np.int32)
    bias_values = np.zeros((num_seqs, BIAS_WIDTH), np.float32)
    for i, row in enumerate(rows):
        entries = bias_entries(row.params, row.suppressed_ids)
        bias_ids[i, : len(entries)] = list(entries)
        bias_values[i, : len(entries)] = list(entries.values())
    return SamplingBatch(
        temperature=column(lambda r: r.params.temperature, 0.0, np.float32),
        top_k=column(lambda r: r.params.top_k, 0, np.int32),
        top_p=column(lambda r: r.params.top_p, 1.0, np.float32),
        min_p=column(lambda r: r.params.min_p, 0.0, np.float32),
        repetition_penalty=column(lambda r: r.params.repetition_penalty, 1.0, np.float32),
        presence_penalty=column(lambda r: r.params.presence_penalty, 0.0, np.float32),
        frequency_penalty=column(lambda r: r.params.frequency_penalty, 0.0, np.float32),
        seeds=column(lambda r: r.seed % 2**32, 0, np.uint32),
        steps=column(lambda r: r.step, 0, np.int32),
        slots=column(lambda r: r.slot, 0, np.int32),
        bias_ids=bias_ids,
        bias_values=bias_values,
        wants_top_logprobs=column(lambda r: r.params.logprobs is not None, False, bool),
        token_bitmask=token_bitmask,
        constrained=column(lambda r: r.constrained, False, bool),
    )
