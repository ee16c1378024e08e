"""jserve's C++ CPU kernels (XLA FFI): paged attention against the reference on ragged batches, the int8
matmul bit for bit against XLA's int8 dot, and the library built once."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jserve import cpu_kernels
from jserve.models import quantization

from attention_cases import BATCHES, assert_matches_reference, make_case

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


def test_all_padding_batch_is_zeros():
    case = make_case([(0, 0)])
    out = cpu_kernels.ragged_paged_attention(*case.kernel_args(), scale=case.scale)
    assert not out.any()


# rows x outputs x depth: SmolLM2's projections, depths that are not whole 64-byte vectors, more rows than
# one pass over the weight takes (8), and work large enough to be split over threads (> 4M multiply-adds).
@pytest.mark.parametrize("rows, outputs, depth", [(4, 192, 576), (2, 1536, 576), (8, 576, 1536), (1, 7, 3),
                                                  (3, 33, 100), (13, 70, 130), (4, 4100, 576),
                                                  (128, 576, 1536), (37, 300, 100)])  # fmt: skip
def test_int8_matmul_equals_xla_int8_dot(rows, outputs, depth):
    rng = np.random.default_rng(rows * outputs + depth)
    x = rng.integers(-128, 128, (rows, depth)).astype(np.int8)  # -128 too: the kernel shifts x by 128
    w = rng.integers(-128, 128, (outputs, depth)).astype(np.int8)
    expected = jax.lax.dot_general(x, w, (((1,), (1,)), ((), ())), preferred_element_type=jnp.int32)
    np.testing.assert_array_equal(jax.jit(cpu_kernels.int8_matmul)(x, w), expected)


def test_int8_linear_takes_the_kernel_for_decode_sized_steps_only():
    q, scale = quantization.quantize_rows(jnp.asarray(np.random.default_rng(0).normal(size=(64, 32))))
    matmul = jax.jit(lambda x: quantization.int8_matmul(x, q, scale))
    x = jnp.asarray(np.random.default_rng(1).normal(size=(128, 32)), jnp.float32)
    largest = quantization.CPU_KERNEL_MAX_ROWS // 2  # tokens: two digit rows each
    decode, prefill = x[:largest], x[: largest + 1]
    assert "jserve_int8_matmul" in matmul.lower(decode).as_text()
    assert "jserve_int8_matmul" not in matmul.lower(prefill).as_text()
    np.testing.assert_array_equal(matmul(decode), matmul(prefill)[:largest])


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
