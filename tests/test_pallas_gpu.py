"""The GPU ragged paged-attention kernel: against the reference in Pallas interpret mode, and lowered to Triton.

Interpret mode runs the kernel's program body on CPU; lowering for CUDA (which needs no GPU) checks that
every operation it uses has a Triton lowering, for the shapes the engine uses.
"""

import dataclasses
import importlib.util
import json
import re
from functools import partial
from pathlib import Path

import pytest

from pallas_kernels.gpu import DecodeLaunch, PrefillLaunch, launch, ragged_paged_attention

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
BENCHMARK = Path(__file__).parent.parent / "benchmarks" / "attention_kernels.py"
# Small K/V blocks and several splits, so decode rows cross blocks and splits.
SMALL_BLOCKS = dict(decode=DecodeLaunch(pages_per_block=2), prefill=PrefillLaunch(pages_per_block=2), kv_splits=3)


@pytest.mark.parametrize("name", CASES)
def test_kernel_matches_reference_in_interpret_mode(name):
    params = dict(CASES[name])
    case = make_case(BATCHES[params.pop("batch")], **params)
    out = ragged_paged_attention(*case.kernel_args(), scale=case.scale, sliding_window=case.sliding_window,
                                 soft_cap=case.soft_cap, interpret=True, **SMALL_BLOCKS)  # fmt: skip
    assert_matches_reference(out, case, params.get("dtype", "float32"))


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_unsplit_decodes_are_written_in_place_beside_prefill_rows_in_interpret_mode(dtype):
    """One split (steps whose sequence slots fill the GPU): decode rows skip the partials and their merge and
    write the output the prefill rows write too."""
    case = make_case(BATCHES["mixed"], page_size=16, head_dim=64, heads=8, kv_heads=2, dtype=dtype)
    out = ragged_paged_attention(*case.kernel_args(), scale=case.scale, interpret=True,
                                 **{**SMALL_BLOCKS, "kv_splits": 1})  # fmt: skip
    assert_matches_reference(out, case, dtype)


def test_lone_decode_step_in_interpret_mode():
    case = make_case(LONE_DECODE, pad=False)
    out = ragged_paged_attention(*case.kernel_args(), scale=case.scale, interpret=True, **SMALL_BLOCKS)
    assert_matches_reference(out, case, "float32")


def test_default_block_sizes_match_reference():
    case = make_case(BATCHES["mixed"], page_size=16, heads=8, kv_heads=2)
    out = ragged_paged_attention(*case.kernel_args(), scale=case.scale, interpret=True)
    assert_matches_reference(out, case, "float32")


@pytest.mark.parametrize(
    "heads,kv_heads,head_dim,dtype,window,soft_cap,kernels",
    [
        (32, 8, 128, "bfloat16", None, None, 2),
        (9, 3, 64, "float32", 16, None, 3),
        (16, 16, 64, "bfloat16", None, 30.0, 2),
    ],
    ids=["llama8b-bf16", "gqa3-f32-window", "mha-softcap"],
)
def test_kernel_lowers_to_triton(heads, kv_heads, head_dim, dtype, window, soft_cap, kernels):
    """Prefill and decode kernels; with 3 KV heads, 64 sequence slots leave SMs to fill: decodes split (2), and
    the kernel merging their splits lowers too."""
    kernel = partial(ragged_paged_attention, scale=head_dim**-0.5, sliding_window=window, soft_cap=soft_cap)
    text = lowered_kernel_text(kernel, heads, kv_heads, head_dim, dtype, page_size=16, max_pages=128)
    assert text.count("__gpu$xla.gpu.triton") == kernels
    assert ("ragged_paged_attention_merge" in text) == (kernels == 3)


def launches_in(text: str) -> list[tuple[int, int, int]]:
    """(num_warps, num_stages, grid_z) of each Triton call of a lowered kernel: prefill, decode, the merge of a
    decode's splits."""
    configs = re.findall(r"grid_z = (\d+) : i32.*?num_stages = (\d+) : i32, num_warps = (\d+) : i32", text)
    return [(int(warps), int(stages), int(grid_z)) for grid_z, stages, warps in configs]


def test_launch_settings_are_the_ones_measured_for_the_gpu_and_shape(monkeypatch):
    """A tuned.json entry for (GPU, dtype, head_dim, group, page_size) sets both programs' launches there, and
    only there: another GPU keeps the defaults (4 warps, 2 stages; 64 sequences of 8 KV heads fill an H100's
    132 SMs twice over without splitting)."""
    shape = launch.AttentionShape("NVIDIA H200", "bfloat16", 128, 4, 16)
    measured = (DecodeLaunch(num_warps=8, num_stages=3, programs_per_core=8), PrefillLaunch(num_warps=2, num_stages=1))
    monkeypatch.setattr(launch, "_tuned", lambda: {shape: measured})

    def lowered(device_kind: str) -> str:
        kernel = partial(ragged_paged_attention, scale=0.1, device_kind=device_kind)
        return lowered_kernel_text(kernel, 32, 8, 128, "bfloat16", page_size=16, max_pages=128)

    # decode splits: 8 programs per SM x 132 SMs over 64 sequences x 8 KV heads = 3 (rounded up), then
    # the kernel merging them (one warp, whatever the GPU)
    assert launches_in(lowered("NVIDIA H200")) == [(2, 1, 1), (8, 3, 3), (1, 3, 1)]
    assert launches_in(lowered("NVIDIA H100 80GB HBM3")) == [(4, 2, 1), (4, 2, 1)]


def test_tuned_entries_are_read_back(tmp_path, monkeypatch):
    shape = launch.AttentionShape("NVIDIA H100 80GB HBM3", "bfloat16", 128, 4, 16)
    decode, prefill = DecodeLaunch(pages_per_block=8, programs_per_core=4), PrefillLaunch(block_q=32)
    file = tmp_path / "tuned.json"
    file.write_text(json.dumps([launch.tuned_entry(shape, decode, prefill, decode_us=300.0)]))
    monkeypatch.setattr(launch, "TUNED_FILE", file)
    launch._tuned.cache_clear()
    try:
        assert launch.tuned_launches(shape) == (decode, prefill)
        other = dataclasses.replace(shape, page_size=32)
        assert launch.tuned_launches(other) == (DecodeLaunch(), PrefillLaunch())
    finally:
        launch._tuned.cache_clear()


def test_the_launch_search_keeps_the_fastest_setting_one_field_at_a_time():
    """benchmarks/attention_kernels.py --tune: coordinate search over a cost with one best setting per field."""
    spec = importlib.util.spec_from_file_location("attention_kernels", BENCHMARK)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    best = dict(pages_per_block=8, num_warps=8, num_stages=3, programs_per_core=1)

    def cost(setting: DecodeLaunch) -> float:
        fields = dataclasses.asdict(setting)
        return float("inf") if setting.num_warps == 2 else sum(abs(fields[k] - v) for k, v in best.items())

    choices = {"pages_per_block": (1, 2, 4, 8, 16), **module.DECODE_CHOICES}
    found, tried = module.coordinate_search(DecodeLaunch(pages_per_block=4), choices, cost, deadline=float("inf"))
    assert dataclasses.asdict(found) == best and tried[found] == 0
    assert len(tried) < 5 * 3 * 4 * 4  # not the whole grid
