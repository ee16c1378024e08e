"""jserve's C++ kernel for weights kept in GGUF block formats, against gguf-py's dequantization.

Blocks are random bytes with small finite scales: every bit pattern of a block is a valid weight, so this
covers the layouts' every field (gguf-py cannot quantize the K-quants, but it dequantizes them all).
"""

import ctypes
from pathlib import Path

import jax.numpy as jnp
import numpy as np
import pytest
from gguf import GGML_QUANT_SIZES, GGMLQuantizationType
from gguf.quants import dequantize

from jserve import cpu_kernels
from jserve.loader.gguf_blocks import GgufBlocks, fuse_blocks
from jserve.models.norm import rms_norm

G = GGMLQuantizationType
# Where each format's float16 scales sit in its block (the rest of the block is any bytes).
HALF_OFFSETS = {G.Q4_0: [0], G.Q4_1: [0, 2], G.Q5_0: [0], G.Q5_1: [0, 2], G.Q8_0: [0], G.Q4_K: [0, 2],
                G.Q5_K: [0, 2], G.Q6_K: [208]}  # fmt: skip

# The codes of the formats whose weights have an offset term: w = d·q + offset.
CODES = {G.Q4_0: slice(2, 18), G.Q4_1: slice(4, 20), G.Q5_0: slice(2, 22), G.Q5_1: slice(4, 24), G.Q4_K: slice(16, 144),
         G.Q5_K: slice(16, 176)}  # fmt: skip
DIGIT_RANGE = 127 * 2**14  # |v| for a block's largest input (gguf_tiles.h)
pytestmark = pytest.mark.skipif(not cpu_kernels.available(), reason="needs a C++ compiler to build jserve's kernels")


def random_blocks(rng, ggml_type, rows: int, depth: int) -> np.ndarray:
    """[rows, bytes per row] of random blocks whose scales are float16 values around 0.01."""
    block, size = GGML_QUANT_SIZES[ggml_type]
    raw = rng.integers(0, 256, (rows, depth // block, size), dtype=np.uint8)
    for at in HALF_OFFSETS[ggml_type]:
        scales = (rng.standard_normal((rows, depth // block)) * 0.01).astype(np.float16)
        raw[..., at : at + 2] = scales.view(np.uint8).reshape(rows, depth // block, 2)
    return raw.reshape(rows, -1)


def kernel_weight(pieces: list[tuple[int, np.ndarray]], depth: int) -> tuple[jnp.ndarray, tuple]:
    """Pieces (type, [rows, bytes]) as the loader hands them to the kernel: flat bytes and segments."""
    flat, segments = fuse_blocks([GgufBlocks(int(t), rows, depth) for t, rows in pieces])
    return jnp.asarray(flat), segments


def digit_product(x: np.ndarray, w: np.ndarray, ggml_type) -> tuple[np.ndarray, np.ndarray]:
    """What the kernel computes, in float64: per 32 inputs v = round(x · R / max|x|) (x ≈ s·v),
    times the exact weights; and the bound on its distance from x · wᵀ (Σ |w| · s / 2 per block)."""
    dense = dequantize(w, ggml_type).reshape(w.shape[0], -1).astype(np.float64)
    # Q4_0's −8·d, Q4_1's m and Q4_K's −dmin·m (the weight with all codes 0) multiply the exact Σx; the
    # rest meets v.
    offset = np.zeros_like(dense)
    if ggml_type in CODES:
        blocks = w.reshape(w.shape[0], -1, GGML_QUANT_SIZES[ggml_type][1]).copy()
        blocks[..., CODES[ggml_type]] = 0
        offset = dequantize(blocks.reshape(w.shape), ggml_type).reshape(dense.shape).astype(np.float64)
    scaled = dense - offset
    blocks = x.reshape(x.shape[0], -1, 32)
    top = np.abs(blocks).max(-1, keepdims=True)
    inverse = np.where(top == 0, np.float32(0), np.float32(DIGIT_RANGE) / np.where(top == 0, 1, top)).astype(np.float32)
    v = np.rint(blocks * inverse)  # float32 products, rounded half to even, as the kernel's
    approx = (v * (top.astype(np.float64) / DIGIT_RANGE)).reshape(x.shape)
    bound = np.abs(scaled).reshape(1, w.shape[0], -1, 32).sum(-1) * (top / DIGIT_RANGE / 2).reshape(x.shape[0], 1, -1)
    return approx @ scaled.T + x.astype(np.float64) @ offset.T, bound.sum(-1)


@pytest.mark.parametrize("ggml_type", list(HALF_OFFSETS), ids=lambda t: t.name)
def test_matmul_equals_the_dequantized_weight(ggml_type):
    """The integer digits' product (its only approximation, x's v), within its bound of the float product."""
    rng = np.random.default_rng(int(ggml_type))
    depth, rows = 512, 40
    w = random_blocks(rng, ggml_type, rows, depth)
    dense = dequantize(w, ggml_type).reshape(rows, depth)
    x = rng.standard_normal((9, depth)).astype(np.float32)
    flat, segments = kernel_weight([(ggml_type, w)], depth)
    y = np.asarray(cpu_kernels.gguf_linear(jnp.asarray(x), flat, segments, jnp.array([7], jnp.int32)))
    expected = x[:7].astype(np.float64) @ dense.T.astype(np.float64)
    digits, bound = digit_product(x[:7], w, ggml_type)
    np.testing.assert_allclose(y[:7], digits, atol=1e-6 * np.abs(expected).max(), rtol=0)
    assert (np.abs(y[:7] - expected) <= bound + 1e-6 * np.abs(expected).max()).all()
    assert not y[7:].any(), "padding rows come back as zeros"


@pytest.mark.parametrize("ggml_type", list(HALF_OFFSETS), ids=lambda t: t.name)
def test_rows_are_dequantized_exactly(ggml_type):
    rng = np.random.default_rng(1)
    table = random_blocks(rng, ggml_type, 30, 256)
    ids = np.array([3, 0, 29, 3])
    flat, _ = kernel_weight([(ggml_type, table)], 256)
    got = np.asarray(cpu_kernels.gguf_rows(flat, int(ggml_type), 256, jnp.asarray(ids)))
    np.testing.assert_array_equal(got, dequantize(table, ggml_type).reshape(30, 256)[ids])


def test_segments_of_different_formats_and_a_norm():
    """A fused weight whose pieces the file stores in different formats (q and k Q4_K, v Q6_K), after an
    RMSNorm, for token counts around the kernel's tiles."""
    rng = np.random.default_rng(2)
    depth = 256
    pieces = [(G.Q4_K, 24), (G.Q6_K, 8), (G.Q8_0, 5)]
    blocks = [random_blocks(rng, t, rows, depth) for t, rows in pieces]
    dense = np.concatenate([dequantize(b, t).reshape(rows, depth) for b, (t, rows) in zip(blocks, pieces, strict=True)])
    w, segments = kernel_weight([(t, b) for b, (t, _) in zip(blocks, pieces, strict=True)], depth)
    norm_weight = jnp.asarray(rng.standard_normal(depth).astype(np.float32))
    for tokens in (1, 3, 4, 17):
        x = jnp.asarray(rng.standard_normal((tokens, depth)).astype(np.float32))
        y = np.asarray(cpu_kernels.gguf_linear(x, w, segments, norm=(norm_weight, 1e-5)))
        expected = np.asarray(rms_norm(x, norm_weight, 1e-5), np.float64) @ dense.T.astype(np.float64)
        np.testing.assert_allclose(y, expected, atol=1e-5 * np.abs(expected).max(), rtol=0)


@pytest.mark.parametrize("ggml_type", list(HALF_OFFSETS), ids=lambda t: t.name)
def test_a_tokens_product_does_not_depend_on_its_step(ggml_type):
    """A step of hundreds of tokens (several token runs of the kernel's work items) gives each token what a
    step of a few gives it, bit for bit."""
    rng = np.random.default_rng(4)
    w = random_blocks(rng, ggml_type, 48, 256)
    x = jnp.asarray(rng.standard_normal((300, 256)).astype(np.float32))
    norm = (jnp.asarray(rng.standard_normal(256).astype(np.float32)), 1e-5)
    flat, segments = kernel_weight([(ggml_type, w)], 256)
    got = np.asarray(cpu_kernels.gguf_linear(x, flat, segments, norm=norm))
    np.testing.assert_array_equal(got[:3], np.asarray(cpu_kernels.gguf_linear(x[:3], flat, segments, norm=norm)))
    np.testing.assert_array_equal(got[-5:], np.asarray(cpu_kernels.gguf_linear(x[-5:], flat, segments, norm=norm)))


@pytest.mark.parametrize("ggml_type", list(HALF_OFFSETS), ids=lambda t: t.name)
def test_largest_codes_and_digits_do_not_overflow(ggml_type):
    """Every code at its largest (Q8_0's at -128 or 127) against inputs whose digits are all at their largest (c2 at
    ±127, c1 at ±64): the int16 sums of the AVX2 pass sit closest to their limit, and still give the exact
    integer products."""
    rng = np.random.default_rng(6)
    depth = 256
    w = random_blocks(rng, ggml_type, 24, depth).reshape(24, depth // GGML_QUANT_SIZES[ggml_type][0], -1)
    halves = np.zeros(w.shape[-1], bool)
    for at in HALF_OFFSETS[ggml_type]:
        halves[at : at + 2] = True
    w[..., ~halves] = 0xFF
    if ggml_type == G.Q8_0:  # signed codes: half the rows at -128, half at 127
        w[:12, :, ~halves] = 0x80
        w[12:, :, ~halves] = 0x7F
    w = w.reshape(24, -1)
    signs = np.repeat(rng.choice([-1.0, 1.0], (3, depth // 32)), 32, axis=1)
    # All of a block's digits c2 at ±127; or c1 at ±64 too: v = 2¹⁴·(k + ½) rounds c2 up and leaves c1 = -64.
    halves = np.where(np.arange(depth) % 32 == 0, 1.0, (rng.integers(0, 126, (3, depth)) + 0.5) / 127)
    flat, segments = kernel_weight([(ggml_type, w)], depth)
    for x in (signs.astype(np.float32), (signs * halves).astype(np.float32)):
        y = np.asarray(cpu_kernels.gguf_linear(jnp.asarray(x), flat, segments))
        digits, _ = digit_product(x, w, ggml_type)
        np.testing.assert_allclose(y, digits, atol=1e-6 * np.abs(digits).max(), rtol=0)


# Builds of the tiles for CPUs with fewer instructions than this one's: (compiler flags, what it reports).
NARROWER_BUILDS = {"avx2": (("-mno-avx512f",), b"AVX2"), "scalar": (("-mno-avx2", "-mno-avx512f"), None)}


@pytest.mark.parametrize("build", list(NARROWER_BUILDS))
def test_narrower_instruction_sets_compute_the_same(tmp_path, build):
    """The AVX2 pass (a build without AVX-512) and the scalar loops (a build without AVX2) give this CPU's
    kernel's products: the same digits and integer sums, then float steps (which may round differently)."""
    flags, reports = NARROWER_BUILDS[build]
    if build == "avx2" and not cpu_kernels.cpu_has("avx2"):
        pytest.skip(reason="this CPU has no AVX2 to run the AVX2 pass on")
    library = tmp_path / f"{build}.so"
    sources = sorted(Path(cpu_kernels.__file__).parent.glob("gguf_tiles*.cc"))
    cpu_kernels.compile_library(cpu_kernels._compiler(), sources, library, flags)
    built = ctypes.CDLL(str(library))
    built.JserveGgufTilesVectorized.restype = ctypes.c_char_p
    assert built.JserveGgufTilesVectorized() == reports
    rng = np.random.default_rng(5)
    for ggml_type in list(HALF_OFFSETS):
        w = random_blocks(rng, ggml_type, 37, 256)
        flat, segments = kernel_weight([(ggml_type, w)], 256)
        x = rng.standard_normal((5, 256)).astype(np.float32)
        expected = np.asarray(cpu_kernels.gguf_linear(jnp.asarray(x), flat, segments))
        tiles, got = np.asarray(flat), np.zeros((5, 37), np.float32)
        pointer = ctypes.c_void_p
        built.JserveGgufTilesProduct(ctypes.c_int64(int(ggml_type)), tiles.ctypes.data_as(pointer), ctypes.c_int64(37),
                                     ctypes.c_int64(256), x.ctypes.data_as(pointer), ctypes.c_int64(5),
                                     got.ctypes.data_as(pointer))  # fmt: skip
        np.testing.assert_allclose(got, expected, atol=1e-6 * np.abs(expected).max(), rtol=0)


def test_unsupported_layouts_are_refused():
    w = jnp.zeros(18 * 3, jnp.uint8)
    x = jnp.zeros((1, 96), jnp.float32)
    with pytest.raises(Exception, match="unsupported type"):
        cpu_kernels.gguf_linear(x, w, ((int(G.Q2_K), 1),))
    with pytest.raises(Exception, match="do not match"):
        cpu_kernels.gguf_linear(x, w, ((int(G.Q4_0), 2),))
