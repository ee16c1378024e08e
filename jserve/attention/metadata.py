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


def single_sequence_input(
    token_ids: np.ndarray, start_pos: int, pages: np.ndarray, page_size: int, padded_len: int, all_logits: bool = False
) -> ModelInput:
    """A batch of one sequence whose tokens continue at `start_pos`, padded to `padded_len` query tokens."""
    n = len(token_ids)
    positions = np.zeros(padded_len, np.int32)
    positions[:n] = np.arange(start_pos, start_pos + n)
    slots = np.full(padded_len, PAD_SLOT, np.int32)
    slots[:n] = pages[positions[:n] // page_size] * page_size + positions[:n] % page_size
    ids = np.zeros(padded_len, np.int32)
    ids[:n] = token_ids
    return ModelInput(
        token_ids=ids,
        attention=AttentionMetadata(
            positions=positions,
            slot_mapping=slots,
            page_tables=np.asarray(pages, np.int32)[None, :],
            context_lens=np.array([start_pos + n], np.int32),
            query_start_loc=np.array([0, n], np.int32),
        ),
        logits_indices=np.arange(n, dtype=np.int32) if all_logits else np.array([n - 1], np.int32),
    )
