"""Greedy decoding of one sequence straight on the model layer (the engine of #3 supersedes it for serving).

Prefill runs padded to a power-of-two bucket; decode runs one token per step; both read and write the
paged KV cache through the same metadata interface the engine uses.
"""

from __future__ import annotations

from collections.abc import Iterator

import jax.numpy as jnp
import numpy as np

from jserve.attention import SequenceChunk, allocate_kv_cache, build_model_input
from jserve.loader import LoadedModel
from jserve.models import forward_step

PAGE_SIZE = 16


def bucket(n: int, minimum: int = 16) -> int:
    return max(minimum, 1 << (n - 1).bit_length())


def prompt_logits(model: LoadedModel, prompt_ids: list[int]) -> np.ndarray:
    """float32 logits [len(prompt), vocab] for every prompt position."""
    n = len(prompt_ids)
    pages = np.arange(-(-n // PAGE_SIZE), dtype=np.int32)
    kv = allocate_kv_cache(model.config, len(pages), PAGE_SIZE, model.dtype)
    batch = build_model_input(
        [SequenceChunk(np.asarray(prompt_ids), 0, pages)], PAGE_SIZE, bucket(n), 1, len(pages), True
    )
    logits, _ = forward_step(model.graphdef, model.params, kv, batch)
    return np.asarray(logits)


def greedy_generate(
    model: LoadedModel, prompt_ids: list[int], max_new_tokens: int, stop_ids: tuple[int, ...] | None = None
) -> list[int]:
    return list(iter_greedy(model, prompt_ids, max_new_tokens, stop_ids))


def iter_greedy(
    model: LoadedModel, prompt_ids: list[int], max_new_tokens: int, stop_ids: tuple[int, ...] | None = None
) -> Iterator[int]:
    """Yields up to max_new_tokens argmax tokens after the prompt, ending early at a stop id (included)."""
    stop = set(model.config.eos_token_ids if stop_ids is None else stop_ids)
    n = len(prompt_ids)
    pages = np.arange(-(-(n + max_new_tokens) // PAGE_SIZE), dtype=np.int32)
    kv = allocate_kv_cache(model.config, len(pages), PAGE_SIZE, model.dtype)
    batch = build_model_input([SequenceChunk(np.asarray(prompt_ids), 0, pages)], PAGE_SIZE, bucket(n), 1, len(pages))
    for step in range(max_new_tokens):
        logits, kv = forward_step(model.graphdef, model.params, kv, batch)
        token = int(jnp.argmax(logits[-1]))
        yield token
        if token in stop:
            return
        batch = build_model_input([SequenceChunk(np.array([token]), n + step, pages)], PAGE_SIZE, 1, 1, len(pages))
