"""What one model step needs to know about its batch: the paged-attention metadata interface.

A step runs a flat, padded list of T query tokens drawn from S sequences (prefill chunks and decode
tokens mixed). The host (the engine's runner) builds these arrays; every device function reads them.
"""

from __future__ import annotations

from dataclasses import dataclass, replace

import jax
import jax.numpy as jnp
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
    # int32 []: where a layer's pages start in the cache (set by for_layer; the page tables stay as built)
    first_page: jax.Array | None = None

    @property
    def real_tokens(self) -> jax.Array:
        """int32 [1]: how many leading query tokens are real; the rest of the step is padding."""
        return self.query_start_loc[-1:]

    def for_layer(self, first_page: int, page_size: int) -> AttentionMetadata:
        """The metadata of the layer whose pages start at first_page of the cache (see KVPages): its slots
        shifted there (padding slots left as they are), and first_page for the page tables. A kernel adds
        first_page as it reads a table (the Triton kernel, at no cost), or takes `cache_page_tables`: adding
        it here would be a kernel launch a layer on GPUs."""
        slots = self.slot_mapping
        shifted = jnp.where(slots < 0, slots, slots + first_page * page_size)
        return replace(self, slot_mapping=shifted, first_page=jnp.asarray(first_page, jnp.int32))

    @property
    def cache_page_tables(self) -> jax.Array:
        """The page tables as rows of the cache: first_page added."""
        return self.page_tables if self.first_page is None else self.page_tables + self.first_page


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
    page_tables = np.zeros((num_seqs, max_pages), np.int32)
    for i, chunk in enumerate(chunks[:num_seqs]):  # per sequence; everything per token is vectorised
        page_tables[i, : len(chunk.pages)] = chunk.pages
    token_ids = np.concatenate([c.token_ids for c in chunks]) if chunks else np.zeros(0, np.int32)
    starts = np.array([c.start_pos for c in chunks], np.int32)
    lens = np.array([len(c.token_ids) for c in chunks], np.int32)
    return ragged_model_input(token_ids, starts, lens, page_tables, page_size, num_tokens, num_seqs, all_logits)


def ragged_model_input(
    token_ids: np.ndarray,
    starts: np.ndarray,
    lens: np.ndarray,
    page_tables: np.ndarray,
    page_size: int,
    num_tokens: int,
    num_seqs: int,
    all_logits: bool = False,
) -> ModelInput:
    """The padded batch of n sequences given as arrays: sequence i runs lens[i] of `token_ids` (concatenated)
    from position starts[i], with its pages in page_tables[i] ([num_seqs, max_pages], padding rows zero: the
    step's own page tables, not copied)."""
    n = len(lens)
    cu = np.zeros(n + 1, np.int32)
    np.cumsum(lens, out=cu[1:])
    total = int(cu[-1])
    if total > num_tokens or n > num_seqs:
        raise ValueError(f"{total} tokens in {n} sequences exceed the bucket ({num_tokens}, {num_seqs})")
    if total == n:  # one token per sequence (a decode step)
        seq_of_token, real_pos = np.arange(n), starts
    else:
        seq_of_token = np.repeat(np.arange(n), lens)
        real_pos = starts[seq_of_token] + np.arange(total, dtype=np.int32) - cu[seq_of_token]
    ids = np.zeros(num_tokens, np.int32)
    ids[:total] = token_ids
    positions = np.zeros(num_tokens, np.int32)
    positions[:total] = real_pos
    slots = np.full(num_tokens, PAD_SLOT, np.int32)
    slots[:total] = page_tables[seq_of_token, real_pos // page_size] * page_size + real_pos % page_size
    context_lens = np.zeros(num_seqs, np.int32)
    context_lens[:n] = starts + lens
    query_start_loc = np.full(num_seqs + 1, total, np.int32)
    query_start_loc[: n + 1] = cu
    if all_logits:
        logits_indices = np.arange(total, dtype=np.int32)
    else:
        logits_indices = np.zeros(num_seqs, np.int32)
        logits_indices[:n] = cu[1:] - 1
    return ModelInput(
        token_ids=ids,
        attention=AttentionMetadata(positions, slots, page_tables, context_lens, query_start_loc),
        logits_indices=logits_indices,
    )
