"""jserve's C++ kernel for weights kept in GGUF block formats, against gguf-py's dequantization.

Blocks are random bytes with small finite scales: every bit pattern of a block is a valid weight, so this
covers the layouts' every field (gguf-py cannot quantize the K-quants, but it dequantizes them all).
"""

import jax.numpy as jnp
import numpy as np
import pytest
from gguf import GGML_QUANT_SIZES, GGMLQuantizationType
from gguf.quants import dequantize

from jserve import cpu_kernels
from jserve.models.gguf_matmul import KERNEL_TOKENS, gguf_matmul
from jserve.models.norm import rms_norm

G = GGMLQuantizationType
# Where each format's float16 scales sit in its block (the rest of the block is any bytes).
HALF_OFFSETS = {G.Q4_0: [0], G.Q4_1: [0, 2], G.Q5_0: [0], G.Q5_1: [0, 2], G.Q8_0: [0], G.Q4_K: [0, 2],
                G.Q5_K: [0, 2], G.Q6_K: [208]}  # fmt: skip

pytestmark = pytest.mark.skipif(not cpu_kernels.available(), reason="needs a C++ compiler to build jserve's kernels")


def random_blocks(rng, ggml_type, rows: int, depth: int) -> np.ndarray:
    """[rows, bytes per row] of random blocks whose scales are float16 values around 0.01."""
    block, size = GGML_QUANT_SIZES[ggml_type]
    raw = rng.integers(0, 256, (rows, depth // block, size), dtype=np.uint8)
    for at in HALF_OFFSETS[ggml_type]:
        scales = (rng.standard_normal((rows, depth // block)) * 0.01).astype(np.float16)
        raw[..., at : at + 2] = scales.view(np.uint8).reshape(rows, depth // block, 2)
    return raw.reshape(rows, -1)


@pytest.mark.parametrize("ggml_type", list(HALF_OFFSETS), ids=lambda t: t.name)
def test_matmul_equals_the_dequantized_weight(ggml_type):
    rng = np.random.default_rng(int(ggml_type))
    depth, rows = 512, 40
    w = random_blocks(rng, ggml_type, rows, depth)
    dense = dequantize(w, ggml_type).reshape(rows, depth)
    x = rng.standard_normal((9, depth)).astype(np.float32)
    y = np.asarray(cpu_kernels.gguf_linear(jnp.asarray(x), jnp.asarray(w.reshape(-1)), ((int(ggml_type), rows),),
                                           jnp.array([7], jnp.int32)))  # fmt: skip
    expected = x[:7].astype(np.float64) @ dense.T.astype(np.float64)
    np.testing.assert_allclose(y[:7], expected, atol=1e-6 * np.abs(expected).max(), rtol=0)
    assert not y[7:].any(), "padding rows come back as zeros"


@pytest.mark.parametrize("ggml_type", list(HALF_OFFSETS), ids=lambda t: t.name)
def test_rows_are_dequantized_exactly(ggml_type):
    rng = np.random.default_rng(1)
    table = random_blocks(rng, ggml_type, 30, 256)
    ids = np.array([3, 0, 29, 3])
    got = np.asarray(cpu_kernels.gguf_rows(jnp.asarray(table.reshape(-1)), int(ggml_type), 256, jnp.asarray(ids)))
    np.testing.assert_array_equal(got, dequantize(table, ggml_type).reshape(30, 256)[ids])


def test_segments_of_different_formats_and_a_norm():
    """A fused weight whose pieces the file stores in different formats (q and k Q4_K, v Q6_K), after an
    RMSNorm, for token counts around the kernel's tiles."""
    rng = np.random.default_rng(2)
    depth = 256
    pieces = [(G.Q4_K, 24), (G.Q6_K, 8), (G.Q8_0, 5)]
    blocks = [random_blocks(rng, t, rows, depth) for t, rows in pieces]
    dense = np.concatenate([dequantize(b, t).reshape(rows, depth) for b, (t, rows) in zip(blocks, pieces, strict=True)])
    w = jnp.asarray(np.concatenate([b.reshape(-1) for b in blocks]))
    norm_weight = jnp.asarray(rng.standard_normal(depth).astype(np.float32))
    segments = tuple((int(t), rows) for t, rows in pieces)
    for tokens in (1, 3, 4, 17):
        x = jnp.asarray(rng.standard_normal((tokens, depth)).astype(np.float32))
        y = np.asarray(cpu_kernels.gguf_linear(x, w, segments, norm=(norm_weight, 1e-5)))
        expected = np.asarray(rms_norm(x, norm_weight, 1e-5), np.float64) @ dense.T.astype(np.float64)
        np.testing.assert_allclose(y, expected, atol=1e-5 * np.abs(expected).max(), rtol=0)


def test_a_whole_weight_is_dequantized_exactly():
    rng = np.random.default_rng(3)
    pieces = [(G.Q4_K, 6), (G.Q6_K, 3), (G.Q4_1, 4)]
    blocks = [random_blocks(rng, t, rows, 256) for t, rows in pieces]
    w = jnp.asarray(np.concatenate([b.reshape(-1) for b in blocks]))
    got = np.asarray(cpu_kernels.gguf_dequantize(w, tuple((int(t), rows) for t, rows in pieces), 256))
    expected = np.concatenate(
        [dequantize(b, t).reshape(rows, 256) for b, (t, rows) in zip(blocks, pieces, strict=True)]
    )
    np.testing.assert_array_equal(got, expected)


def test_large_steps_dequantize_for_xlas_matmul():
    """Past KERNEL_TOKENS tokens gguf_matmul multiplies the dequantized weight with XLA: the same products
    (and norm) as the kernel's, up to summation order."""
    rng = np.random.default_rng(4)
    w = random_blocks(rng, G.Q4_1, 48, 128)
    x = jnp.asarray(rng.standard_normal((KERNEL_TOKENS + 40, 128)).astype(np.float32))
    norm = (jnp.asarray(rng.standard_normal(128).astype(np.float32)), 1e-5)
    segments = ((int(G.Q4_1), 48),)
    flat = jnp.asarray(w.reshape(-1))
    got = np.asarray(gguf_matmul(x, flat, segments, norm=norm))
    expected = np.asarray(cpu_kernels.gguf_linear(x, flat, segments, norm=norm))
    np.testing.assert_allclose(got, expected, atol=1e-5 * np.abs(expected).max(), rtol=0)


def test_unsupported_layouts_are_refused():
    w = jnp.zeros(18 * 3, jnp.uint8)
    x = jnp.zeros((1, 96), jnp.float32)
    with pytest.raises(Exception, match="unsupported type"):
        cpu_kernels.gguf_linear(x, w, ((int(G.Q2_K), 1),))
    with pytest.raises(Exception, match="do not match"):
        cpu_kernels.gguf_linear(x, w, ((int(G.Q4_0), 2),))
