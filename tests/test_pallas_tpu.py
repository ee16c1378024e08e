"""The Mosaic (TPU) ragged paged-attention kernel against the plain-JAX reference, in TPU interpret mode on CPU."""

import functools

import jax
import numpy as np
import pytest
from jax.experimental.pallas import tpu as pltpu

from pallas_kernels.tpu import ragged_paged_attention

from accelerators import lowering_for
from attention_cases import BATCHES, LONE_DECODE, MIXED, assert_matches_reference, make_case

QUERIES_PER_BLOCK = 8  # small blocks: chunks span several rows, contexts several KV blocks


def run_kernel(case, pages_per_block):
    with pltpu.force_tpu_interpret_mode():
        return ragged_paged_attention(*case.kernel_args(), scale=case.scale, sliding_window=case.sliding_window,
                                      soft_cap=case.soft_cap, block_q=QUERIES_PER_BLOCK,
                                      pages_per_block=pages_per_block)  # fmt: skip


CASES = [
    # batch, page_size, pages_per_block, heads, kv_heads, head_dim, dtype, sliding_window, soft_cap
    pytest.param("mixed", 16, 2, 4, 4, 128, "float32", None, None, id="mixed-page16-dim128-gqa1"),
    pytest.param("mixed", 32, 1, 6, 2, 64, "float32", None, None, id="mixed-page32-dim64-gqa3"),
    pytest.param("decode", 16, 3, 8, 2, 64, "float32", None, None, id="decode-page16-dim64-gqa4"),
    pytest.param("decode", 64, 1, 8, 1, 128, "float32", None, None, id="decode-page64-dim128-gqa8"),
    pytest.param("prefill", 32, 2, 8, 1, 64, "float32", None, None, id="prefill-page32-dim64-gqa8"),
    pytest.param("prefill", 64, 2, 6, 2, 128, "float32", None, None, id="prefill-page64-dim128-gqa3"),
    pytest.param("mixed", 16, 2, 8, 2, 64, "float32", 20, None, id="mixed-page16-gqa4-window20"),
    pytest.param("decode", 16, 2, 4, 4, 64, "float32", 7, None, id="decode-page16-gqa1-window7"),
    pytest.param("prefill", 32, 1, 6, 2, 64, "float32", 45, None, id="prefill-page32-gqa3-window45"),
    pytest.param("mixed", 32, 2, 8, 2, 64, "float32", None, 2.0, id="mixed-page32-gqa4-softcap"),
    pytest.param("mixed", 16, 3, 8, 2, 64, "float32", 12, 2.0, id="mixed-page16-gqa4-window12-softcap"),
    pytest.param("mixed", 16, 2, 8, 2, 128, "bfloat16", None, None, id="mixed-page16-dim128-gqa4-bf16"),
    pytest.param("decode", 32, 2, 8, 1, 64, "bfloat16", 30, None, id="decode-page32-gqa8-window30-bf16"),
    pytest.param("prefill", 64, 1, 6, 2, 64, "bfloat16", None, 2.0, id="prefill-page64-gqa3-softcap-bf16"),
]


@pytest.mark.parametrize("batch,page_size,pages_per_block,heads,kv_heads,head_dim,dtype,sliding_window,soft_cap", CASES)
def test_kernel_matches_reference(
    batch, page_size, pages_per_block, heads, kv_heads, head_dim, dtype, sliding_window, soft_cap
):
    case = make_case(BATCHES[batch], page_size=page_size, heads=heads, kv_heads=kv_heads, head_dim=head_dim,
                     dtype=dtype, sliding_window=sliding_window, soft_cap=soft_cap)  # fmt: skip
    out = run_kernel(case, pages_per_block)
    assert out.shape == case.q.shape and out.dtype == case.q.dtype
    assert_matches_reference(out, case, dtype)


def test_default_block_sizes():
    case = make_case(MIXED, heads=8, kv_heads=2, sliding_window=40)
    out = ragged_paged_attention(*case.kernel_args(), scale=case.scale, sliding_window=40, interpret=True)
    assert_matches_reference(out, case, "float32")


def test_lone_decode_step():
    case = make_case(LONE_DECODE, pad=False)
    assert_matches_reference(run_kernel(case, pages_per_block=2), case, "float32")


def test_batch_of_padding_only_gives_zeros():
    case = make_case([])
    np.testing.assert_array_equal(np.asarray(run_kernel(case, pages_per_block=2)), 0.0)


def test_double_buffering_has_no_dma_races():
    """The race detector sees every buffer read ordered after its DMA's wait and before the slot's reuse."""
    from jax._src.pallas.mosaic.interpret import interpret_pallas_call  # the detector's state: no public API

    case = make_case(MIXED, sliding_window=20)
    with pltpu.force_tpu_interpret_mode(pltpu.InterpretParams(detect_races=True)):
        ragged_paged_attention(
            *case.kernel_args(), scale=case.scale, sliding_window=20, block_q=QUERIES_PER_BLOCK, pages_per_block=2
        ).block_until_ready()
    assert not interpret_pallas_call.races.races_found


@pytest.mark.parametrize("dtype,kv_heads", [("float32", 2), ("bfloat16", 8)], ids=["float32", "bfloat16"])
def test_lowers_to_mosaic_for_tpu(dtype, kv_heads):
    """Pallas -> Mosaic lowering for a TPU (v5e) succeeds on CPU; Mosaic's own compilation needs a TPU."""
    case = make_case(MIXED, heads=4 * kv_heads, kv_heads=kv_heads, head_dim=128, dtype=dtype)
    attention = functools.partial(ragged_paged_attention, scale=0.1, sliding_window=64, soft_cap=30.0)
    with lowering_for("tpu"):
        exported = jax.export.export(jax.jit(attention), platforms=["tpu"])(*case.kernel_args())
    assert "tpu_custom_call" in exported.mlir_module()
