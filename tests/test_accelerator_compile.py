"""The engine's 8B step compiled for a GPU and a TPU on this CPU host, which has neither.

Lowering (tests/test_accelerator_lowering.py) checks that every operation has a lowering; compiling goes on to
what the accelerator's own compiler decides: Mosaic compiling the TPU attention kernel (which interpret mode
cannot check: page tables whose width is not a multiple of 128 once failed there), and XLA:GPU's buffer
assignment (carried state that left a `lax.cond` was copied every step: jserve/engine/carried_state.py),
rematerialization (jserve/attention/kv_cache.py, cache_writer_compiler_options), the device conditionals
left in a step (jserve/engine/stages.py), and the CUDA graphs the step's kernels make.
Both run `benchmarks/compiled_step.py` in a process of its own, which fetches the compiler plugins into
jserve's cache on first use (the CUDA plugin with ptxas, and libtpu: about 1.3 GB from the package index,
which the suite needs as it needs it for the default model).
"""

import json
import re
import subprocess
import sys
from pathlib import Path

SCRIPT = Path(__file__).parent.parent / "benchmarks" / "compiled_step.py"


def compile_for(target: str, tmp_path: Path, *options: str) -> list[dict]:
    """The script's reports, one per bucket, of the 8B step compiled for `target`."""
    report = tmp_path / f"{target}.json"
    command = [sys.executable, str(SCRIPT), "--target", target, "--json", str(report), *options]
    done = subprocess.run(command, capture_output=True, text=True, timeout=1200)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-5000:]
    return json.loads(report.read_text())


def test_an_8b_step_for_an_h200_updates_its_carried_state_in_place(tmp_path):
    """A lone decode (held logits written over one row) and a full bucket (over all of them), with a 48 GiB
    cache: the K/V cache aliased, no copy of 1 MB or more (before carried_state.py, 164–295 MB were copied
    every step), nothing computed twice (XLA's rematerialization, which counts each in-place K/V write as
    a new cache, recomputed 45 and 134 kernels, an attention output projection in 31 layers at 256), and
    every kernel in one CUDA graph (a loop, or the sampled tokens' memcpy, once launched from the host
    between two: prefill rows' binary search at 256, `.at[:rows].set` at 1)."""
    reports = compile_for("h200", tmp_path, "--buckets", "1", "256", "--kv-cache-gib", "48")
    for report in reports:
        assert report["kv_aliased"], report
        assert report["big_copies"] == [], report
        assert report["rematerialized"] == {}, report
        assert report["launches"]["attention"] >= 32  # the Triton kernel, for each of the 32 layers
        assert "conditional" not in report["control_flow"], report  # a greedy step: no optional stage
        assert "while, unknown trip count" not in report["control_flow"], report
        assert (report["graphs"], report["outside_graphs"]) == (1, []), report


def test_an_8b_step_for_an_h200_runs_its_stages_without_device_conditionals(tmp_path):
    """Biases, penalties, a grammar's mask, the draw, logprobs and prompt scores all compiled in, as where some
    row needs each: none waits on a device conditional (top-k/top-p keep one, before sorting whole rows)."""
    stages = ["adjust", "draw", "logprobs", "prompt_scores"]
    (report,) = compile_for("h200", tmp_path, "--buckets", "256", "--run-stages", *stages)
    assert "conditional" not in report["control_flow"], report
    assert report["launches"]["prompt_scores"] >= 1 and report["launches"]["sampling"] > 10, report
    (report,) = compile_for("h200", tmp_path, "--buckets", "256", "--run-stages", *stages, "filters")
    assert report["control_flow"]["conditional"] == 1, report


def test_a_mixture_of_experts_step_for_an_h200_multiplies_the_routed_experts_only(tmp_path):
    """Qwen3-30B-A3B's shape (128 experts, top 8), its first 4 layers: each expert projection is the grouped
    kernel, and no copy of 1 MB or more is made. XLA's own ragged_dot there is one dense GEMM over the rows
    broadcast to all 128 experts, masked: a [rows, 128, in] copy of the rows per projection (1.07 GB at 256)."""
    layers = 4
    options = ["--shape", "qwen3-30b-a3b", "--layers", str(layers), "--buckets", "1", "256", "--hlo-dir", str(tmp_path)]
    for report in compile_for("h200", tmp_path, *options):
        assert report["big_copies"] == [], report
        assert report["temp_mib"] < 256, report
        hlo = (tmp_path / f"step-{report['bucket']}.hlo").read_text()
        kernels = re.findall(r"custom-call\(.*grouped_matmul/pallas_call", hlo)
        assert len(kernels) == 2 * layers  # gate/up and down, a layer
        assert (report["graphs"], report["outside_graphs"]) == (1, []), report


def test_an_8b_step_for_a_tpu_compiles_its_attention_kernel(tmp_path):
    """A context of 1,000 tokens: 63 pages of 16, a page-table width Mosaic once refused."""
    (report,) = compile_for("tpu-v6e", tmp_path, "--buckets", "1", "--max-model-len", "1000")
    assert report["kv_aliased"], report
