"""The GPU ragged paged-attention kernel: against the reference in Pallas interpret mode, and lowered to Triton.

Interpret mode runs the kernel's program body on CPU; lowering for CUDA (which needs no GPU) checks that
every operation it uses has a Triton lowering, for the shapes the engine uses.
"""

from functools import partial

import pytest

from pallas_kernels.gpu import ragged_paged_attention

from accelerators import lowered_kernel_text
from attention_cases import BATCHES, LONE_DECODE, assert_matches_reference, make_case

# Each line covers some of: batch kind, page size, head_dim, GQA ratio (heads / kv heads), dtype, extras.
CASES = {
    "decode-p16-d64-gqa1": dict(batch="decode", page_size=16, head_dim=64, heads=4, kv_heads=4),
    "decode-p32-d128-gqa4": dict(batch="decode", page_size=32, head_dim=128, heads=8, kv_heads=2),
    "decode-p64-d64-gqa8-bf16": dict(batch="decode", page_size=64, head_dim=64, heads=8, kv_heads=1, dtype="bfloat16"),
    "prefill-p16-d128-gqa3": dict(batch="prefill", page_size=16, head_dim=128, heads=6, kv_heads=2),
    "prefill-p32-d64-gqa8": dict(batch="prefill", page_size=32, head_dim=64, heads=8, kv_heads=1),
    "prefill-p64-d64-gqa1-bf16": dict(
        batch="prefill", page_size=64, head_dim=64, heads=2, kv_heads=2, dtype="bfloat16"
    ),
    "mixed-p16-d64-gqa4": dict(batch="mixed", page_size=16, head_dim=64, heads=8, kv_heads=2),
    "mixed-p32-d128-gqa3-bf16": dict(batch="mixed", page_size=32, head_dim=128, heads=3, kv_heads=1, dtype="bfloat16"),
    "mixed-p64-d64-gqa1": dict(batch="mixed", page_size=64, head_dim=64, heads=2, kv_heads=2),
    "mixed-window": dict(batch="mixed", page_size=16, head_dim=64, heads=4, kv_heads=2, sliding_window=6),
    "mixed-window-long": dict(batch="mixed", page_size=16, head_dim=64, heads=4, kv_heads=1, sliding_window=40),
    "mixed-softcap": dict(batch="mixed", page_size=16, head_dim=64, heads=8, kv_heads=2, soft_cap=5.0),
}


@pytest.mark.parametrize("name", CASES)
def test_kernel_matches_reference_in_interpret_mode(name):
    params = dict(CASES[name])
    case = make_case(BATCHES[params.pop("batch")], **params)
    # Small K/V blocks and several splits, so decode rows cross blocks and splits.
    out = ragged_paged_attention(*case.kernel_args(), scale=case.scale, sliding_window=case.sliding_window,
                                 soft_cap=case.soft_cap, interpret=True, pages_per_block=2, kv_splits=3)  # fmt: skip
    assert_matches_reference(out, case, params.get("dtype", "float32"))


def test_lone_decode_step_in_interpret_mode():
    case = make_case(LONE_DECODE, pad=False)
    out = ragged_paged_attention(*case.kernel_args(), scale=case.scale, interpret=True, pages_per_block=2, kv_splits=3)
    assert_matches_reference(out, case, "float32")


def test_default_block_sizes_match_reference():
    case = make_case(BATCHES["mixed"], page_size=16, heads=8, kv_heads=2)
    out = ragged_paged_attention(*case.kernel_args(), scale=case.scale, interpret=True)
    assert_matches_reference(out, case, "float32")


@pytest.mark.parametrize(
    "heads,kv_heads,head_dim,dtype,window,soft_cap",
    [(32, 8, 128, "bfloat16", None, None), (9, 3, 64, "float32", 16, None), (16, 16, 64, "bfloat16", None, 30.0)],
    ids=["llama8b-bf16", "gqa3-f32-window", "mha-softcap"],
)
def test_kernel_lowers_to_triton(heads, kv_heads, head_dim, dtype, window, soft_cap):
    kernel = partial(ragged_paged_attention, scale=head_dim**-0.5, sliding_window=window, soft_cap=soft_cap)
    text = lowered_kernel_text(kernel, heads, kv_heads, head_dim, dtype, page_size=16, max_pages=128)
    assert text.count("__gpu$xla.gpu.triton") == 2  # the prefill and the split-KV decode kernel
