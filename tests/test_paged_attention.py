"""The plain-JAX paged attention against a dense per-sequence attention, and the model's batch invariance."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jserve import cpu_kernels
from jserve.attention import (
    KVPages,
    SequenceChunk,
    allocate_kv_cache,
    build_model_input,
    paged_attention,
    resolve_attention_backend,
    write_kv,
)
from jserve.loader import load_model

from tiny_models import VOCAB_SIZE, jserve_prompt_logits, model_forward, save_tiny_checkpoint


def dense_attention(q, k, v, q_positions, scale, window, soft_cap):
    """q [n, H, D] at q_positions attending to k/v [ctx, Hkv, D] (positions 0..ctx-1), plain softmax."""
    group = q.shape[1] // k.shape[1]
    k, v = np.repeat(k, group, axis=1), np.repeat(v, group, axis=1)
    scores = np.einsum("nhd,khd->hnk", q, k).astype(np.float64) * scale
    if soft_cap is not None:
        scores = soft_cap * np.tanh(scores / soft_cap)
    kv_pos = np.arange(k.shape[0])
    mask = kv_pos[None, :] <= q_positions[:, None]
    if window is not None:
        mask &= kv_pos[None, :] > q_positions[:, None] - window
    scores = np.where(mask[None], scores, -np.inf)
    probs = np.exp(scores - scores.max(-1, keepdims=True))
    probs /= probs.sum(-1, keepdims=True)
    return np.einsum("hnk,khd->nhd", probs, v)


# (new query tokens, tokens already cached) per sequence: decode, fresh prefill, chunk continuing
# mid-page, an empty sequence slot, a long decode spanning several page blocks, a chunk of several query
# blocks continuing mid-page, and a two-token chunk.
SEQUENCES = [(1, 9), (7, 0), (5, 8), (0, 0), (1, 70), (37, 20), (2, 0)]
# (sequences, trailing padding tokens, empty trailing sequence slots): a mixed batch, and the one-token
# step of a lone decode (no padding at all).
BATCHES = {"mixed": (SEQUENCES, 3, 1), "lone-decode": ([(1, 70)], 0, 0)}


@pytest.mark.parametrize("batch", BATCHES)
@pytest.mark.parametrize("page_size", [4, 16])
@pytest.mark.parametrize("heads,kv_heads", [(4, 4), (6, 2), (8, 2), (8, 1)])
@pytest.mark.parametrize("window,soft_cap", [(None, None), (6, None), (None, 5.0)])
def test_paged_attention_matches_dense(batch, page_size, heads, kv_heads, window, soft_cap):
    sequences, pad_tokens, pad_seqs = BATCHES[batch]
    rng = np.random.default_rng(0)
    dim, num_pages = 16, 96
    scale = dim**-0.5
    pages = KVPages(*(jnp.asarray(rng.normal(size=(num_pages, page_size, kv_heads, dim)), jnp.float32) for _ in "kv"))
    free = list(rng.permutation(num_pages))
    chunks, histories, queries = [], [], []
    for new, cached in sequences:
        total = new + cached
        seq_pages = np.array([free.pop() for _ in range(-(-total // page_size))], np.int32)
        k_hist, v_hist = rng.normal(size=(2, total, kv_heads, dim)).astype(np.float32)
        slots = seq_pages[np.arange(cached) // page_size] * page_size + np.arange(cached) % page_size
        flat = lambda a: a.reshape(-1, kv_heads, dim)  # noqa: E731
        pages = KVPages(  # the history as if earlier steps had written it
            flat(pages.k).at[slots].set(k_hist[:cached]).reshape(pages.k.shape),
            flat(pages.v).at[slots].set(v_hist[:cached]).reshape(pages.v.shape),
        )
        chunks.append(SequenceChunk(np.zeros(new, np.int32), cached, seq_pages))
        histories.append((k_hist, v_hist))
        queries.append(rng.normal(size=(new, heads, dim)).astype(np.float32))
    num_tokens = sum(n for n, _ in sequences) + pad_tokens
    meta = jax.tree.map(
        jnp.asarray, build_model_input(chunks, page_size, num_tokens, len(sequences) + pad_seqs, max_pages=32).attention
    )
    q = np.zeros((num_tokens, heads, dim), np.float32)
    q[: sum(len(x) for x in queries)] = np.concatenate(queries)
    new_k = np.zeros((num_tokens, kv_heads, dim), np.float32)
    new_v = np.zeros_like(new_k)
    offset = 0
    for (new, cached), (k_hist, v_hist) in zip(sequences, histories, strict=True):
        new_k[offset : offset + new], new_v[offset : offset + new] = k_hist[cached:], v_hist[cached:]
        offset += new

    before = pages
    pages = write_kv(pages, jnp.asarray(new_k), jnp.asarray(new_v), meta.slot_mapping)
    out = np.asarray(paged_attention(jnp.asarray(q), pages, meta, scale=scale, sliding_window=window,
                                     soft_cap=soft_cap, pages_per_block=2))  # fmt: skip

    offset = 0
    for (new, cached), (k_hist, v_hist), qs in zip(sequences, histories, queries, strict=True):
        if new:
            expected = dense_attention(qs, k_hist, v_hist, np.arange(cached, cached + new), scale, window, soft_cap)
            np.testing.assert_allclose(out[offset : offset + new], expected, atol=1e-5, rtol=1e-5)
        offset += new
    assert np.isfinite(out).all()  # padding rows included
    # Padding tokens write nothing: only the new tokens' slots changed.
    changed = np.flatnonzero(np.any(np.asarray(pages.k != before.k).reshape(-1, kv_heads * dim), axis=1))
    written = np.asarray(meta.slot_mapping)[np.asarray(meta.slot_mapping) >= 0]
    assert set(changed) <= set(written)


NEEDS_CPU_KERNELS = pytest.mark.skipif(
    not cpu_kernels.available(), reason="needs a C++ compiler to build jserve's kernels"
)


@pytest.mark.parametrize("backend", ["reference", pytest.param("cpu", marks=NEEDS_CPU_KERNELS), "pallas"])
def test_each_layer_writes_and_reads_its_own_pages(backend):
    """Every layer's pages share one array: a layer's metadata points into its part, so a write to layer 1
    changes nothing of layers 0 and 2, and layer 1's attention reads what the layer itself wrote (the Triton
    kernel, interpreted here, adds the layer's first page to the page ids itself)."""
    attention = resolve_attention_backend(backend)
    rng = np.random.default_rng(5)
    num_layers, pages_per_layer, page_size, kv_heads, dim = 3, 4, 4, 2, 64
    shape = (num_layers * pages_per_layer, page_size, kv_heads, dim)
    cache = KVPages(*(jnp.asarray(rng.normal(size=shape), jnp.float32) for _ in "kv"), num_layers)
    tokens = 6
    batch = build_model_input([SequenceChunk(np.zeros(tokens, np.int32), 0, np.array([3, 1], np.int32))],
                              page_size, 8, 2, 2)  # fmt: skip
    q, k, v = (jnp.asarray(rng.normal(size=(8, h, dim)), jnp.float32) for h in (4, kv_heads, kv_heads))
    out, written = attention(q, k, v, cache, batch.attention.for_layer(cache.first_page(1), page_size), scale=0.125)

    layer_1 = slice(pages_per_layer, 2 * pages_per_layer)
    for before, after in ((cache.k, written.k), (cache.v, written.v)):
        np.testing.assert_array_equal(np.delete(np.asarray(after), np.s_[layer_1], 0),
                                      np.delete(np.asarray(before), np.s_[layer_1], 0))  # fmt: skip
    slots = np.asarray(batch.attention.slot_mapping)[:tokens]
    np.testing.assert_array_equal(
        np.asarray(written.k[layer_1]).reshape(-1, kv_heads, dim)[slots], np.asarray(k)[:tokens]
    )
    expected = dense_attention(np.asarray(q)[:tokens], np.asarray(k)[:tokens], np.asarray(v)[:tokens],
                               np.arange(tokens), 0.125, None, None)  # fmt: skip
    np.testing.assert_allclose(np.asarray(out)[:tokens], expected, atol=1e-5)


@pytest.fixture(scope="module")
def tiny_llama(tmp_path_factory):
    folder = tmp_path_factory.mktemp("llama")
    save_tiny_checkpoint(folder, "llama")
    return load_model(folder, dtype="float32")


def test_logits_do_not_depend_on_chunking_or_batch(tiny_llama):
    """A prompt prefilled whole, in chunks split mid-page, or beside another sequence gives the same logits."""
    model, page_size = tiny_llama, 16
    rng = np.random.default_rng(3)
    a, b = rng.integers(0, VOCAB_SIZE, 30), rng.integers(0, VOCAB_SIZE, 21)
    whole = jserve_prompt_logits(model, a.tolist())

    kv = allocate_kv_cache(model.config, 8, page_size, model.dtype)
    a_pages, b_pages = np.array([5, 1], np.int32), np.array([2, 7], np.int32)
    first = build_model_input([SequenceChunk(a[:13], 0, a_pages)], page_size, 16, 2, 4, all_logits=True)
    logits1, kv = model_forward(model, kv, first)
    # A's second chunk runs in one step with all of B (ragged batch, interleaved pages).
    second = build_model_input(
        [SequenceChunk(a[13:], 13, a_pages), SequenceChunk(b, 0, b_pages)], page_size, 64, 2, 4, all_logits=True
    )
    logits2, kv = model_forward(model, kv, second)
    # Equal up to float32 noise: XLA orders matmul reductions by batch shape, so bits may differ.
    np.testing.assert_allclose(np.asarray(logits1)[:13], whole[:13], atol=1e-4)
    np.testing.assert_allclose(np.asarray(logits2)[:17], whole[13:], atol=1e-4)
    np.testing.assert_allclose(np.asarray(logits2)[17:38], jserve_prompt_logits(model, b.tolist()), atol=1e-4)
