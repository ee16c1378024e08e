"""Ragged paged-attention batches for kernel tests: random pages and queries, and the reference output."""

from __future__ import annotations

from dataclasses import dataclass

import jax
import jax.numpy as jnp
import numpy as np

from jserve.attention import AttentionMetadata, KVPages, SequenceChunk, build_model_input, paged_attention

# (new query tokens, tokens already cached) per sequence: first tokens, contexts ending mid-page, long
# contexts, chunks continuing mid-page over several query blocks, page-aligned chunks, two-token chunks;
# (0, 0) is an empty sequence slot mid-batch.
DECODE = [(1, 0), (1, 9), (0, 0), (1, 70), (1, 31), (1, 140)]
PREFILL = [(7, 0), (37, 20), (2, 0), (0, 0), (20, 69), (16, 32)]
MIXED = [(1, 9), (7, 0), (5, 8), (0, 0), (1, 70), (37, 20), (2, 0)]
BATCHES = {"decode": DECODE, "prefill": PREFILL, "mixed": MIXED}
LONE_DECODE = [(1, 40)]  # a lone decode's step: one token, one sequence, no padding (make_case(..., pad=False))
PAD_TOKENS = 5  # trailing padding query tokens, which must come back as zeros
PAD_SEQS = 2  # trailing empty sequence slots
TOLERANCE = {"float32": 1e-5, "bfloat16": 2e-2}


@dataclass(frozen=True)
class AttentionCase:
    q: jax.Array  # [T, heads, head_dim]
    k_pages: jax.Array  # [P, page_size, kv_heads, head_dim]
    v_pages: jax.Array
    meta: AttentionMetadata
    scale: float
    sliding_window: int | None
    soft_cap: float | None

    @property
    def num_real_tokens(self) -> int:
        return int(self.meta.query_start_loc[-1])

    def kernel_args(self) -> tuple:
        m = self.meta
        return self.q, self.k_pages, self.v_pages, m.context_lens, m.page_tables, m.query_start_loc

    def reference(self) -> jax.Array:
        pages = KVPages(self.k_pages, self.v_pages)
        return paged_attention(
            self.q, pages, self.meta, scale=self.scale, sliding_window=self.sliding_window, soft_cap=self.soft_cap
        )


def make_case(
    sequences: list[tuple[int, int]],
    *,
    page_size: int = 16,
    heads: int = 4,
    kv_heads: int = 2,
    head_dim: int = 64,
    dtype: str = "float32",
    sliding_window: int | None = None,
    soft_cap: float | None = None,
    seed: int = 0,
    pad: bool = True,
) -> AttentionCase:
    """Pages filled with random K/V (as if the sequences' histories and this step's tokens were written)."""
    rng = np.random.default_rng(seed)
    used = [-(-(new + cached) // page_size) for new, cached in sequences]
    num_pages = sum(used) + 3  # spare pages hold noise no sequence may read
    free = list(rng.permutation(num_pages))
    chunks = [
        SequenceChunk(np.zeros(new, np.int32), cached, np.array([free.pop() for _ in range(n)], np.int32))
        for (new, cached), n in zip(sequences, used, strict=True)
    ]
    num_tokens = sum(new for new, _ in sequences) + PAD_TOKENS * pad
    batch = build_model_input(chunks, page_size, num_tokens, len(sequences) + PAD_SEQS * pad, max(used, default=0) + 2)

    def normal(*shape):
        return jnp.asarray(rng.normal(size=shape), dtype)

    return AttentionCase(
        q=normal(num_tokens, heads, head_dim),
        k_pages=normal(num_pages, page_size, kv_heads, head_dim),
        v_pages=normal(num_pages, page_size, kv_heads, head_dim),
        meta=jax.tree.map(jnp.asarray, batch.attention),
        scale=head_dim**-0.5,
        sliding_window=sliding_window,
        soft_cap=soft_cap,
    )


def assert_matches_reference(out: jax.Array, case: AttentionCase, dtype: str) -> None:
    out = np.asarray(out.astype(jnp.float32))
    expected = np.asarray(case.reference().astype(jnp.float32))
    np.testing.assert_allclose(out, expected, atol=TOLERANCE[dtype], rtol=0)
    assert not out[case.num_real_tokens :].any(), "padding tokens must come back as zeros"
