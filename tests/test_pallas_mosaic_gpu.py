"""The Hopper ragged paged-attention kernel: against the reference in Pallas' GPU interpret mode, and lowered
to Mosaic GPU.

GPU interpret mode runs the kernel on CPU while simulating the GPU's memories, TMA copies, barriers and
WGMMAs; lowering for CUDA (which needs no GPU: without one Mosaic GPU targets sm90) checks that every
operation, layout and SMEM tiling it uses has a Mosaic GPU lowering, for the shapes the engine uses.

The interpreter needs jax >= 0.11 (`plgpu.InterpretGPUParams`): jax 0.10's cannot read a transposed SMEM view,
the K^T operand of the scores' WGMMA. Lowering works from jax 0.10.2 on.
"""

from functools import partial

import jax
import pytest

from pallas_kernels.mosaic_gpu import INTERPRETABLE, ragged_paged_attention

from accelerators import lowered_kernel_text
from attention_cases import BATCHES, LONE_DECODE, assert_matches_reference, make_case

requires_interpreter = pytest.mark.skipif(
    not INTERPRETABLE,
    reason=f"jax {jax.__version__} has no plgpu.InterpretGPUParams: its Pallas GPU interpreter cannot read a "
    "transposed SMEM view (TransposeTransform), the kernel's K^T WGMMA operand (needs jax >= 0.11)",
)

# Each line covers some of: batch kind, page size, head_dim, GQA ratio (heads / kv heads), dtype, extras.
# WGMMA takes 16-bit inputs: bfloat16 throughout, float16 in places (float32 is refused, see below).
CASES = {
    "decode-p16-d64-gqa1": dict(batch="decode", page_size=16, head_dim=64, heads=4, kv_heads=4),
    "decode-p32-d128-gqa4-f16": dict(batch="decode", page_size=32, head_dim=128, heads=8, kv_heads=2, dtype="float16"),
    "decode-p64-d64-gqa8": dict(batch="decode", page_size=64, head_dim=64, heads=8, kv_heads=1),
    "prefill-p16-d128-gqa3": dict(batch="prefill", page_size=16, head_dim=128, heads=6, kv_heads=2),
    "prefill-p32-d64-gqa8-f16": dict(batch="prefill", page_size=32, head_dim=64, heads=8, kv_heads=1, dtype="float16"),
    "prefill-p64-d64-gqa1": dict(batch="prefill", page_size=64, head_dim=64, heads=2, kv_heads=2),
    "mixed-p16-d64-gqa4": dict(batch="mixed", page_size=16, head_dim=64, heads=8, kv_heads=2),
    "mixed-p32-d128-gqa3": dict(batch="mixed", page_size=32, head_dim=128, heads=3, kv_heads=1),
    "mixed-p64-d64-gqa1-f16": dict(batch="mixed", page_size=64, head_dim=64, heads=2, kv_heads=2, dtype="float16"),
    "mixed-window": dict(batch="mixed", page_size=16, head_dim=64, heads=4, kv_heads=2, sliding_window=6),
    "mixed-window-long": dict(batch="mixed", page_size=16, head_dim=64, heads=4, kv_heads=1, sliding_window=40),
    "mixed-softcap": dict(batch="mixed", page_size=16, head_dim=64, heads=8, kv_heads=2, soft_cap=5.0),
}


def _check(case, dtype, **kernel_args):
    out = ragged_paged_attention(*case.kernel_args(), scale=case.scale, sliding_window=case.sliding_window,
                                 soft_cap=case.soft_cap, interpret=True, **kernel_args)  # fmt: skip
    # float16 rounds like bfloat16's tolerance allows (its 10-bit mantissa only does better).
    assert_matches_reference(out, case, "bfloat16" if dtype == "float16" else dtype)


@requires_interpreter
@pytest.mark.parametrize("name", CASES)
def test_kernel_matches_reference_in_interpret_mode(name):
    params = {"dtype": "bfloat16", **CASES[name]}
    case = make_case(BATCHES[params.pop("batch")], **params)
    # 64-key K/V blocks (the smallest that lowers) and several splits, so rows cross blocks and decode
    # rows cross splits.
    _check(case, params["dtype"], kv_splits=3)


@requires_interpreter
def test_lone_decode_step_in_interpret_mode():
    case = make_case(LONE_DECODE, dtype="bfloat16", pad=False)
    _check(case, "bfloat16", kv_splits=3)


@requires_interpreter
def test_default_block_sizes_match_reference():
    case = make_case(BATCHES["mixed"], page_size=16, heads=8, kv_heads=2, dtype="bfloat16")
    _check(case, "bfloat16")


@requires_interpreter
def test_larger_kv_blocks_match_reference():
    case = make_case(BATCHES["mixed"], page_size=16, heads=4, kv_heads=1, dtype="bfloat16", sliding_window=70)
    _check(case, "bfloat16", pages_per_block=8, kv_splits=2)


@requires_interpreter
def test_taller_tiles_match_reference():
    """Two WGMMA row-blocks per tile (128 rows: more prefill tokens per row)."""
    case = make_case(BATCHES["prefill"], page_size=16, heads=4, kv_heads=2, dtype="bfloat16")
    _check(case, "bfloat16", tile_rows=128, kv_splits=2)


def test_float32_is_refused():
    case = make_case(LONE_DECODE, pad=False)
    with pytest.raises(NotImplementedError, match="float16/bfloat16"):
        ragged_paged_attention(*case.kernel_args(), scale=case.scale, interpret=True)


@pytest.mark.parametrize("head_dim,page_size,pages_per_block", [(96, 16, None), (64, 16, 2), (64, 8, 4)])
def test_shapes_mosaic_gpu_cannot_lower_are_refused(head_dim, page_size, pages_per_block):
    case = make_case(LONE_DECODE, dtype="bfloat16", head_dim=head_dim, page_size=page_size, pad=False)
    with pytest.raises(ValueError, match="multiples of 64"):
        ragged_paged_attention(*case.kernel_args(), scale=case.scale, interpret=True, pages_per_block=pages_per_block)


@pytest.mark.parametrize(
    "heads,kv_heads,head_dim,page_size,dtype,window,soft_cap,blocks",
    [
        (32, 8, 128, 16, "bfloat16", None, None, {}),
        (9, 3, 64, 16, "float16", 16, None, {}),
        (16, 16, 64, 16, "bfloat16", None, 30.0, {}),
        (8, 1, 128, 64, "bfloat16", None, None, dict(tile_rows=128, pages_per_block=1)),
    ],
    ids=["llama8b-bf16", "gqa3-f16-window", "mha-softcap", "gqa8-p64-tall-tiles"],
)
def test_kernel_lowers_to_mosaic_gpu(heads, kv_heads, head_dim, page_size, dtype, window, soft_cap, blocks):
    kernel = partial(ragged_paged_attention, scale=head_dim**-0.5, sliding_window=window, soft_cap=soft_cap, **blocks)
    text = lowered_kernel_text(kernel, heads, kv_heads, head_dim, dtype, page_size, max_pages=2048 // page_size)
    # The prefill and the split-KV decode kernel, each a Mosaic GPU module built for sm90 (Hopper).
    assert text.count("stablehlo.custom_call @mosaic_gpu") == 2
    assert "__gpu$xla.gpu.triton" not in text
