"""jserve's C++ CPU kernels (XLA FFI): paged attention against the reference on ragged batches, the int8
projection against XLA's ops, and the library built once."""

import ctypes
import dataclasses
import functools
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jserve import cpu_kernels
from jserve.attention import KVPages
from jserve.attention.reference import write_kv
from jserve.loader import load_model
from jserve.models import fused, quantization

from attention_cases import BATCHES, LONE_DECODE, assert_matches_reference, make_case

# Each line covers some of: batch kind, page size, head_dim, GQA ratio (heads / kv heads), extras.
CASES = {
    "decode-p16-d64-gqa1": dict(batch="decode", page_size=16, head_dim=64, heads=4, kv_heads=4),
    "decode-p32-d128-gqa4": dict(batch="decode", page_size=32, head_dim=128, heads=8, kv_heads=2),
    "decode-p8-d64-gqa3": dict(batch="decode", page_size=8, head_dim=64, heads=9, kv_heads=3),
    "prefill-p16-d128-gqa3": dict(batch="prefill", page_size=16, head_dim=128, heads=6, kv_heads=2),
    "prefill-p32-d64-gqa8": dict(batch="prefill", page_size=32, head_dim=64, heads=8, kv_heads=1),
    "mixed-p16-d64-gqa4": dict(batch="mixed", page_size=16, head_dim=64, heads=8, kv_heads=2),
    "mixed-p64-d96-gqa1": dict(batch="mixed", page_size=64, head_dim=96, heads=2, kv_heads=2),
    "mixed-window": dict(batch="mixed", page_size=16, head_dim=64, heads=4, kv_heads=2, sliding_window=6),
    "mixed-window-long": dict(batch="mixed", page_size=16, head_dim=64, heads=4, kv_heads=1, sliding_window=40),
    "mixed-softcap": dict(batch="mixed", page_size=16, head_dim=64, heads=8, kv_heads=2, soft_cap=5.0),
}


@pytest.mark.parametrize("name", CASES)
def test_kernel_matches_reference(name):
    params = dict(CASES[name])
    case = make_case(BATCHES[params.pop("batch")], **params)
    kernel = jax.jit(cpu_kernels.ragged_paged_attention, static_argnames=("scale", "sliding_window", "soft_cap"))
    out = kernel(*case.kernel_args(), scale=case.scale, sliding_window=case.sliding_window, soft_cap=case.soft_cap)
    assert_matches_reference(out, case, "float32")


@pytest.fixture(scope="module")
def avx2_attention(tmp_path_factory):
    """The attention kernel built for a CPU with AVX2 and no AVX-512 (8-lane vectors, 8-key tiles), under an
    XLA target of its own; a machine with AVX-512 runs its 16-lane build everywhere else."""
    if not cpu_kernels.cpu_has("avx2"):
        pytest.skip(reason="this CPU has no AVX2 to run the 8-lane attention build on")
    library = tmp_path_factory.mktemp("avx2") / "attention.so"
    source = Path(cpu_kernels.__file__).parent / "paged_attention.cc"
    cpu_kernels.compile_library(cpu_kernels._compiler(), [source], library, ("-mno-avx512f",))
    handler = ctypes.cdll.LoadLibrary(str(library)).JserveRaggedPagedAttention
    jax.ffi.register_ffi_target("jserve_attention_avx2", jax.ffi.pycapsule(handler), platform="cpu")
    return functools.partial(cpu_kernels.ragged_paged_attention, target="jserve_attention_avx2")


@pytest.mark.parametrize("name", CASES)
def test_avx2_build_matches_reference(name, avx2_attention):
    params = dict(CASES[name])
    case = make_case(BATCHES[params.pop("batch")], **params)
    out = avx2_attention(*case.kernel_args(), scale=case.scale, sliding_window=case.sliding_window,
                         soft_cap=case.soft_cap)  # fmt: skip
    assert_matches_reference(out, case, "float32")


@pytest.mark.parametrize("batch", ["decode", "mixed"])
def test_bfloat16_pages(batch):
    """bfloat16 pages (--kv-cache-dtype bfloat16) are read as the floats they hold, as the reference reads them."""
    case = make_case(BATCHES[batch], heads=9, kv_heads=3)
    pages = {name: getattr(case, name).astype(jnp.bfloat16) for name in ("k_pages", "v_pages")}
    case = dataclasses.replace(case, **pages)
    out = cpu_kernels.ragged_paged_attention(*case.kernel_args(), scale=case.scale)
    assert out.dtype == jnp.float32
    assert_matches_reference(out, case, "float32")


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_write_kv_matches_xla_scatter(dtype):
    """The C++ K/V write puts the rows where XLA's scatter does, rounded as XLA converts (inf, NaN, ties
    included), skips padding slots (< 0) and leaves every other slot alone."""
    rng = np.random.default_rng(0)
    rows = rng.standard_normal((12, 3, 64)).astype(np.float32)
    rows[0, 0, :4] = [np.inf, -np.inf, np.nan, 1 + 2**-8]  # 1 + 2^-8 is a bfloat16 tie
    slots = jnp.asarray([5, 70, -1, 0, 127, 33, -1, 64, 9, 100, 101, 2], jnp.int32)
    pages = KVPages(*(jnp.asarray(rng.standard_normal((8, 16, 3, 64)), dtype) for _ in range(2)))
    expected = write_kv(pages, jnp.asarray(rows), jnp.asarray(rows * 2), slots)
    written = jax.jit(cpu_kernels.write_kv)(pages.k, pages.v, jnp.asarray(rows), jnp.asarray(rows * 2), slots)
    for got, want in zip(written, (expected.k, expected.v), strict=True):
        assert got.dtype == want.dtype
        np.testing.assert_array_equal(np.asarray(got.astype(jnp.float32)), np.asarray(want.astype(jnp.float32)))


def test_lone_decode_step():
    case = make_case(LONE_DECODE, pad=False)
    out = cpu_kernels.ragged_paged_attention(*case.kernel_args(), scale=case.scale)
    assert_matches_reference(out, case, "float32")


# Long contexts (decodes around 128 keys and past 256, prefill blocks over hundreds), alone and beside other
# sequences, with and without a sliding window.
LONG_CONTEXTS = [(1, 300), (1, 127), (1, 128), (20, 250), (0, 0), (5, 380)]


@pytest.mark.parametrize("window", [None, 200])
def test_long_contexts_split_over_key_chunks(window):
    for batch in (LONG_CONTEXTS, [(1, 300)]):
        case = make_case(batch, heads=6, kv_heads=2, sliding_window=window)
        out = cpu_kernels.ragged_paged_attention(*case.kernel_args(), scale=case.scale, sliding_window=window or 0)
        assert_matches_reference(out, case, "float32")


def test_a_tokens_attention_does_not_depend_on_its_step():
    """One sequence's decode gives the same bits alone and beside other sequences."""
    case = make_case([(1, 300), (7, 90), (1, 40)], heads=6, kv_heads=2, pad=False)
    q, k, v, context_lens, page_tables, starts = case.kernel_args()
    together = cpu_kernels.ragged_paged_attention(q, k, v, context_lens, page_tables, starts, scale=case.scale)
    alone = cpu_kernels.ragged_paged_attention(
        q[:1], k, v, context_lens[:1], page_tables[:1], starts[:2], scale=case.scale
    )
    np.testing.assert_array_equal(np.asarray(alone[0]), np.asarray(together[0]))


@pytest.mark.parametrize("window", [None, 100])
def test_a_tokens_attention_does_not_depend_on_its_chunk(window):
    """A token gives the same bits as the last of a prefill chunk and as a decode of its own: its keys span
    several key blocks (each attended apart, then merged), and which blocks its item spans must not matter."""
    case = make_case([(16, 300)], heads=6, kv_heads=2, sliding_window=window, pad=False)
    q, k, v, context_lens, page_tables, starts = case.kernel_args()
    chunk = cpu_kernels.ragged_paged_attention(q, k, v, context_lens, page_tables, starts, scale=case.scale,
                                               sliding_window=window or 0)  # fmt: skip
    for back in (1, 9):  # the chunk's last token alone, and its 8th-from-last at the end of a shorter chunk
        alone = cpu_kernels.ragged_paged_attention(
            q[16 - back : 17 - back], k, v, context_lens - back + 1, page_tables, jnp.asarray([0, 1], jnp.int32),
            scale=case.scale, sliding_window=window or 0,
        )  # fmt: skip
        np.testing.assert_array_equal(np.asarray(alone[0]), np.asarray(chunk[16 - back]))


def test_all_padding_batch_is_zeros():
    case = make_case([(0, 0)])
    out = cpu_kernels.ragged_paged_attention(*case.kernel_args(), scale=case.scale)
    assert not out.any()


def test_zeros_are_zero_even_in_reused_memory():
    shapes = [(3000, 16, 3, 64), (7, 5, 3), (1,)]  # gigabyte-scale pages, and buffers smaller than a page
    for shape in shapes:
        jax.block_until_ready(jnp.full(shape, jnp.nan))  # freed, so the allocator may hand it out again
        zeros = cpu_kernels.zeros(shape, jnp.float32, 2)
        assert all(z.shape == shape and z.dtype == jnp.float32 and not np.asarray(z).any() for z in zeros)


needs_int8_kernel = pytest.mark.skipif(
    not cpu_kernels.int8_linear_available(), reason="the int8 kernel needs AVX-512 VNNI and a C++ compiler"
)


def int8_case(tokens, outputs, depth, seed=0):
    """x with some all-zero (padding) rows, and an int8 weight in rows with its scales."""
    rng = np.random.default_rng(seed)
    x = rng.standard_normal((tokens, depth)).astype(np.float32) * rng.uniform(0.01, 100, (tokens, 1)).astype(np.float32)
    x[1::3] = 0
    q, scale = quantization.quantize_rows(rng.standard_normal((outputs, depth)).astype(np.float32))
    return x, q, scale


def tiled(q, scale):
    return quantization.tile(q), scale


def test_tiles_hold_the_rows():
    """tile() pads to whole tiles (inputs to w8a8's groups of 32) and rows_of() reads any rows back from them
    (the embedding lookup)."""
    q = np.random.default_rng(0).integers(-127, 128, (37, 10), dtype=np.int8)
    tiles = np.asarray(quantization.tile(q))
    assert tiles.shape == (3, 8, 16, 4) and tiles.dtype == np.int8
    assert tiles[2, 2, 4, 0] == q[36, 8] and tiles[1, 0, 3, 2] == q[19, 2]
    assert not tiles[2, :, 5:].any() and not tiles[:, 2, :, 2:].any() and not tiles[:, 3:].any()  # zero padding
    ids = jnp.array([0, 36, 15, 16, 5, 5])
    np.testing.assert_array_equal(np.asarray(quantization.rows_of(jnp.asarray(tiles), ids, 10)), q[np.asarray(ids)])
    np.testing.assert_array_equal(np.asarray(quantization.rows_of(jnp.asarray(q), ids, 10)), q[np.asarray(ids)])


# tokens x outputs x depth: SmolLM2's projections and head; depths and outputs that are not whole vectors or
# 16-row blocks; token counts across the 4-token passes and 64-token tiles; work split over threads.
@needs_int8_kernel
@pytest.mark.parametrize("tokens, outputs, depth", [(1, 576, 576), (1, 49152, 576), (3, 576, 1536), (1, 7, 3),
                                                    (5, 33, 100), (13, 70, 130), (64, 1536, 576),
                                                    (130, 50, 200), (200, 576, 576)])  # fmt: skip
def test_int8_linear_matches_xla_ops(tokens, outputs, depth):
    """The same quantization and integer sums as XLA's ops on the rows; the floats differ only where XLA fuses
    a product and a sum into an FMA and the kernel does not, or the other way round (~1e-6 of the row)."""
    x, q, scale = int8_case(tokens, outputs, depth)
    got = np.asarray(jax.jit(cpu_kernels.int8_linear)(x, *tiled(q, scale)))
    expected = np.asarray(jax.jit(quantization.int8_matmul)(x, q, scale))
    assert got.dtype == np.float32 and not got[1::3].any()
    assert (np.abs(got - expected) <= 2e-5 * np.abs(expected).max(axis=1, keepdims=True)).all()


@needs_int8_kernel
@pytest.mark.parametrize("tokens, outputs, depth", [(1, 576, 576), (2, 49152, 576), (3, 576, 1536), (1, 7, 3),
                                                    (5, 33, 100), (13, 70, 130), (64, 1536, 576),
                                                    (130, 50, 200)])  # fmt: skip
def test_w8a8_linear_matches_xla_ops(tokens, outputs, depth):
    """w8a8 (one digit per 32 inputs): the kernel's exact int32 sums per group, scaled and summed in float,
    against XLA's float matmul of the same rounded activations (~1e-6 of the row)."""
    x, q, scale = int8_case(tokens, outputs, depth, seed=6)
    linear = jax.jit(lambda x, q, scale: cpu_kernels.int8_linear(x, q, scale, group=quantization.GROUP))
    got = np.asarray(linear(x, *tiled(q, scale)))
    w8a8 = jax.jit(lambda x: quantization.int8_matmul(x, q, scale, group=quantization.GROUP))
    expected = np.asarray(w8a8(x))
    assert got.dtype == np.float32 and not got[1::3].any()
    assert (np.abs(got - expected) <= 2e-5 * np.abs(expected).max(axis=1, keepdims=True)).all()


def test_w8a8_rounds_each_group_of_32_on_its_own():
    """quantize_groups: every run of 32 inputs gets its own scale (max |x| / 127), so a large value in one
    group leaves the others' precision alone; a ragged last group and all-zero groups are fine; the same
    digits whether XLA's program divides or not (it rounds x · 127 / max, a product)."""
    rng = np.random.default_rng(7)
    x = rng.standard_normal((3, 70)).astype(np.float32)
    x[0, 5] = 1000.0
    x[1, 32:64] = 0
    got = np.asarray(quantization.quantize_groups(jnp.asarray(x), 32))
    for row, values in zip(got, x, strict=True):
        for start in (0, 32, 64):
            group, exact = row[start : start + 32], values[start : start + 32]
            step = np.abs(exact).max() / 127
            assert (np.abs(group - exact) <= step / 2 * (1 + 1e-5) + 1e-12).all()
    assert not got[1, 32:64].any()
    assert np.abs(got[0, 32:] - x[0, 32:]).max() < 0.05  # untouched by row 0's outlier in the first group


@needs_int8_kernel
@pytest.mark.parametrize("tokens, depth", [(1, 576), (70, 130)])
def test_int8_linear_applies_the_norm(tokens, depth):
    """With an RMSNorm, the kernel projects norm(x) as XLA's ops project rms_norm's output (~1e-6 of a row)."""
    x, q, scale = int8_case(tokens, 100, depth, seed=4)
    norm = (jnp.asarray(np.random.default_rng(5).uniform(0.1, 3, depth).astype(np.float32)), 1e-5)
    got = np.asarray(jax.jit(lambda x: cpu_kernels.int8_linear(x, *tiled(q, scale), norm=norm))(x))
    expected = np.asarray(jax.jit(lambda x: quantization.int8_matmul(x, q, scale, norm=norm))(x))
    assert not got[1::3].any() and np.abs(expected).max() > 0
    assert (np.abs(got - expected) <= 2e-5 * np.abs(expected).max(axis=1, keepdims=True)).all()


@needs_int8_kernel
@pytest.mark.parametrize("group", [0, 32])
def test_int8_linear_rows_do_not_depend_on_the_rest_of_the_step(group):
    """A token's output is bit for bit the same alone or among others, at any place in passes and tiles."""
    x, q, scale = int8_case(150, 300, 576, seed=1)
    linear = jax.jit(lambda x, q, scale: cpu_kernels.int8_linear(x, q, scale, group=group))
    q, scale = tiled(q, scale)
    together = np.asarray(linear(x, q, scale))
    for row in (0, 3, 63, 64, 149):
        np.testing.assert_array_equal(np.asarray(linear(x[row : row + 1], q, scale))[0], together[row])
    np.testing.assert_array_equal(np.asarray(linear(x[61:67], q, scale)), together[61:67])


@needs_int8_kernel
@pytest.mark.parametrize("real", [0, 1, 5, 64, 70, 130])
def test_int8_linear_skips_padding_rows(real):
    """Rows past `real_rows` (a step's padding) come back as zeros; the real ones are unchanged."""
    x, *_ = int8_case(130, 1, 200, seed=3)
    q, scale = tiled(*int8_case(1, 70, 200, seed=70)[1:])
    full = np.asarray(jax.jit(cpu_kernels.int8_linear)(x, q, scale))
    padded = np.asarray(jax.jit(cpu_kernels.int8_linear)(x, q, scale, jnp.array([real], jnp.int32)))
    np.testing.assert_array_equal(padded[:real], full[:real])
    assert not padded[real:].any()


@needs_int8_kernel
@pytest.mark.parametrize("shards", [1, 2])
def test_a_fused_projection_gives_each_piece_its_own_output(shards):
    """q/k/v stacked into one weight (fused.py, rows shard by shard): each piece's output is bit for bit what
    its own weight gives, though the pieces' widths are not whole tiles."""
    x, *_ = int8_case(70, 1, 130, seed=2)
    widths = (300, 16, 46)
    pieces = [int8_case(1, width, 130, seed=width)[1:] for width in widths]
    q, scale = (fused.fuse([np.asarray(piece[i]) for piece in pieces], shards) for i in (0, 1))
    together = jax.jit(cpu_kernels.int8_linear)(x, *tiled(jnp.asarray(q), jnp.asarray(scale)))
    outputs = fused.split(together, widths, shards, axis=-1)
    assert [y.shape for y in outputs] == [(70, 300), (70, 16), (70, 46)]
    for (q, scale), y in zip(pieces, outputs, strict=True):
        alone = jax.jit(cpu_kernels.int8_linear)(x, *tiled(q, scale))
        np.testing.assert_array_equal(np.asarray(y), np.asarray(alone))


@needs_int8_kernel
def test_int8_projections_take_the_kernel_on_a_cpu(tiny_llama_checkpoint):
    """Tiles go to the kernel and rows to XLA's ops; the loader tiles unless cpu_int8_kernel is off."""
    q, scale = quantization.quantize_rows(np.random.default_rng(0).normal(size=(64, 32)).astype(np.float32))
    x = jnp.ones((3, 5, 32), jnp.float32)
    lowered = lambda q: jax.jit(lambda x: quantization.int8_matmul(x, q, scale)).lower(x).as_text()  # noqa: E731
    assert "jserve_int8_linear" in lowered(quantization.tile(q)) and "jserve_int8_linear" not in lowered(q)
    assert quantization.tiles_weights() and not quantization.tiles_weights(cpu_kernel=False)
    for cpu_int8_kernel, ndim in ((True, 4), (False, 2)):
        loaded = load_model(tiny_llama_checkpoint[0], "float32", quantization="int8", cpu_int8_kernel=cpu_int8_kernel)
        assert {leaf.ndim for leaf in jax.tree.leaves(loaded.params) if leaf.dtype == np.int8} == {ndim}


def test_library_is_built_once_per_source(tmp_path, monkeypatch):
    """A fresh cache directory gets one library; building again (another process) reuses it."""
    monkeypatch.setenv("JSERVE_CACHE", str(tmp_path))
    path = cpu_kernels.build()
    assert path.is_relative_to(tmp_path) and list(path.parent.iterdir()) == [path]
    mtime = path.stat().st_mtime_ns
    assert cpu_kernels.build() == path and path.stat().st_mtime_ns == mtime


def test_missing_compiler_is_a_clear_error(monkeypatch):
    monkeypatch.setattr(cpu_kernels, "_compiler", lambda: None)
    with pytest.raises(cpu_kernels.KernelUnavailable, match="no C\\+\\+ compiler"):
        cpu_kernels.build()


def test_loading_the_kernels_leaves_the_process_floating_point_alone():
    """Built with -ffast-math but linked without it: no flush-to-zero switched on for the user's numpy."""
    import subprocess
    import sys

    check = (
        "import numpy as np; from jserve import cpu_kernels; cpu_kernels.load(); "
        "assert np.float32(1e-40) * np.float32(2) != 0, 'subnormals flushed to zero'"
    )
    done = subprocess.run([sys.executable, "-c", check], capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr
