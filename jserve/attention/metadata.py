"""What one model step needs to know about its batch: the paged-attention metadata interface.

A step runs a flat, padded list of T query tokens drawn from S sequences (prefill chunks and decode
tokens mixed). The host (the engine's runner) builds these arrays; every device function reads them.
"""

from __future__ import annotations

from dataclasses import dataclass

import jax
import numpy as np

# slot_mapping value for padding tokens: their K/V are written nowhere.
PAD_SLOT = -1


@jax.tree_util.register_dataclass
@dataclass(frozen=True)
class AttentionMetadata:
    positions: jax.Array  # [T] int32: each token's position in its sequence (drives RoPE and causality)
    slot_mapping: jax.Array  # [T] int32: page * page_size + offset to write the token's K/V, PAD_SLOT for padding
    page_tables: jax.Array  # [S, max_pages] int32: the pages of each sequence, in order
    context_lens: jax.Array  # [S] int32: tokens of each sequence in the cache once this step's are written
    query_start_loc: jax.Array  # [S + 1] int32: sequence s owns query tokens [start[s], start[s + 1])


@jax.tree_util.register_dataclass
@dataclass(frozen=True)
class ModelInput:
    token_ids: jax.Array  # [T] int32
    attention: AttentionMetadata
    logits_indices: jax.Array  # [L] int32: the query tokens whose next-token logits the step returns


@dataclass(frozen=True)
class SequenceChunk:
    """Tokens of one sequence to run this step, continuing at start_pos, with the pages the sequence owns."""

    token_ids: np.ndarray
    start_pos: int
    pages: np.ndarray


def build_model_input(
    chunks: list[SequenceChunk],
    page_size: int,
    num_tokens: int,
    num_seqs: int,
    max_pages: int,
    all_logits: bool = False,
) -> ModelInput:
    """Pack chunks into one padded ragged batch of num_tokens query tokens and num_seqs sequence slots.

    Logits come back for each chunk's last token (or every real token with all_logits); padding rows of
    logits_indices point at token 0 and are to be ignored.
    """
    lens = np.array([len(c.token_ids) for c in chunks], np.int32)
    starts = np.concatenate([[0], np.cumsum(lens)]).astype(np.int32)
    if starts[-1] > num_tokens or len(chunks) > num_seqs:
        raise ValueError(f"{starts[-1]} tokens in {len(chunks)} sequences exceed the bucket ({num_tokens}, {num_seqs})")
    ids = np.zeros(num_tokens, np.int32)
    positions = np.zeros(num_tokens, np.int32)
    slots = np.full(num_tokens, PAD_SLOT, np.int32)
    page_tables = np.zeros((num_seqs, max_pages), np.int32)
    context_lens = np.zeros(num_seqs, np.int32)
    for i, chunk in enumerate(chunks):
        span = slice(starts[i], starts[i + 1])
        pos = np.arange(chunk.start_pos, chunk.start_pos + lens[i], dtype=np.int32)
        ids[span], positions[span] = chunk.token_ids, pos
        slots[span] = chunk.pages[pos // page_size] * page_size + pos % page_size
        page_tables[i, : len(chunk.pages)] = chunk.pages
        context_lens[i] = chunk.start_pos + lens[i]
    query_start_loc = np.full(num_seqs + 1, starts[-1], np.int32)
    query_start_loc[: len(starts)] = starts
    logits_indices = np.arange(starts[-1], dtype=np.int32) if all_logits else np.zeros(num_seqs, np.int32)
    if not all_logits:
        logits_indices[: len(chunks)] = starts[1:] - 1
    return ModelInput(
        token_ids=ids,
        attention=AttentionMetadata(positions, slots, page_tables, context_lens, query_start_loc),
        logits_indices=logits_indices,
    )
