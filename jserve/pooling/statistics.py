"""On the device: what each sequence's chunk in a step contributes to its pooled vector.

A long input is computed over several steps (chunked prefill), so pooling keeps per-chunk statistics that
combine exactly across chunks: the first token's state (CLS), the last one's, the element-wise max, the sum,
and the sum weighted by position (weighted mean). Each pooling mode reads one of them (host side: vectors.py).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from jserve.attention.metadata import AttentionMetadata

# The statistic each pooling mode reads.
STATISTIC = {
    "cls": "first",
    "lasttoken": "last",
    "max": "max",
    "mean": "sum",
    "mean_sqrt_len_tokens": "sum",
    "weightedmean": "weighted_sum",
}


def statistics_for(modes: tuple[str, ...]) -> tuple[str, ...]:
    """The statistics the modes read, each once, in the modes' order."""
    return tuple(dict.fromkeys(STATISTIC[mode] for mode in modes))


def chunk_statistics(states: jax.Array, meta: AttentionMetadata, kinds: tuple[str, ...]) -> jax.Array:
    """float32 [S, len(kinds), hidden]: for each of the step's sequence rows, each statistic over the tokens
    of its chunk (`states` [T, hidden]: every token's final hidden state). Rows past the step's sequences
    hold padding."""
    tokens = states.shape[0]
    starts, ends = meta.query_start_loc[:-1], meta.query_start_loc[1:]
    rows = starts.shape[0]
    x = states.astype(jnp.float32)
    # each token's row; padding tokens (past the last sequence's end) get `rows`, which the sums drop
    row_of = jnp.searchsorted(ends, jnp.arange(tokens), side="right")
    out = []
    for kind in kinds:
        if kind == "first":
            out.append(x[jnp.minimum(starts, tokens - 1)])
        elif kind == "last":
            out.append(x[jnp.maximum(ends - 1, 0)])
        elif kind == "max":
            out.append(jax.ops.segment_max(x, row_of, num_segments=rows))
        elif kind == "sum":
            out.append(jax.ops.segment_sum(x, row_of, num_segments=rows))
        elif kind == "weighted_sum":  # position p weighs p + 1, as sentence-transformers' weighted mean
            weights = (meta.positions + 1).astype(jnp.float32)[:, None]
            out.append(jax.ops.segment_sum(x * weights, row_of, num_segments=rows))
        else:
            raise ValueError(f"unknown pooling statistic {kind!r}")
    return jnp.stack(out, axis=1)
