"""jserve's C++ CPU kernels (XLA FFI): paged attention against the reference on ragged batches, and the
library built once."""

import jax
import pytest

from jserve import cpu_kernels

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
