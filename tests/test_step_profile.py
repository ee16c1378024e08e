"""benchmarks/step_profile.py, which the GPU run uses to say where a decode step's device time goes: on a tiny
engine here, every op of the step's HLO gets a kind from the step's named scopes, and a traced stretch of
decode steps reduces to a table whose parts add up."""

import importlib.util
import sys
from pathlib import Path

import numpy as np
import pytest

from jserve.engine.stages import DEVICE_DECIDES

from tiny_models import tiny_engine_args

SCRIPT = Path(__file__).resolve().parents[1] / "benchmarks" / "step_profile.py"


@pytest.fixture(scope="module")
def step_profile():
    spec = importlib.util.spec_from_file_location("step_profile", SCRIPT)
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # (its dataclasses look their module up)
    spec.loader.exec_module(module)
    return module


@pytest.fixture(scope="module")
def llm(tiny_llama_checkpoint):
    import jax

    from jserve import LLM

    folder, _ = tiny_llama_checkpoint
    # As the script does: a cached executable of an older jserve would come back without the step's scopes.
    key = "jax_compilation_cache_include_metadata_in_key"
    before = getattr(jax.config, key)
    jax.config.update(key, True)
    try:
        yield LLM.from_engine_args(tiny_engine_args(folder, attention_backend="reference"))
    finally:
        jax.config.update(key, before)


def test_the_steps_hlo_names_its_parts(step_profile, llm):
    runner = llm.engine.runner
    ops = step_profile.op_kinds(runner.executables[(runner.config.token_buckets[0], DEVICE_DECIDES)].as_text())
    kinds = {op.kind for op in ops.values()}
    assert {"kv_write", "attention", "lm_head", "sampling", "matmul", "other"} <= kinds
    assert all(op.kind in step_profile.KINDS for op in ops.values())
    assert any(op.opcode == "dot" and op.kind == "matmul" for op in ops.values())  # the layers' projections


def test_a_traced_decode_reduces_to_a_table(step_profile, llm):
    profile = step_profile.profile_decode(llm, batch=2, context=20, steps=3, rng=np.random.default_rng(0))
    assert profile.batch == 2 and profile.steps == 3
    assert profile.kinds["attention"][0] > 0 and profile.kinds["matmul"][0] > 0
    assert profile.kinds["kv_write"][1] == llm.engine.model.config.num_layers  # one write a layer a step
    assert 0 < profile.busy_ms <= sum(ms for ms, _ in profile.kinds.values()) + 1e-9  # threads overlap on CPU
    assert profile.top and profile.top[0][2] >= profile.top[-1][2]
    assert not llm.engine.has_unfinished_requests()


def test_gpu_kernel_names_find_their_ops(step_profile):
    """A GPU trace names kernels by their HLO op, by the op with `_` for its `.`, or (libraries' GEMMs, Pallas
    kernels) by themselves; what none of these finds is counted apart, by name."""
    Op, OpTime = step_profile.Op, step_profile.OpTime
    kinds = {"fusion.3": Op("fusion", "other", ""), "custom-call.7": Op("custom-call", "attention", ""),
             "cond.1": Op("conditional", "other", "")}  # fmt: skip
    ops = [OpTime("fusion_3", 0, 10), OpTime("custom-call.7", 10, 30), OpTime("sm90_xmma_gemm_bf16", 40, 50),
           OpTime("cond.1", 0, 90), OpTime("mystery_kernel", 90, 5), OpTime("rms_norm_row", 30, 10),
           OpTime("grouped_matmul", 50, 5)]  # fmt: skip
    profile = step_profile.reduce_trace(ops, kinds, steps=1, wall_s=1e-6, batch=1)
    assert {kind: ms for kind, (ms, _) in profile.kinds.items()} == {
        "attention": 3e-5, "norm": 1e-5, "experts": 5e-6, "matmul": 5e-5, "other": 1e-5
    }  # fmt: skip
    assert profile.unmatched == 1 and profile.unmatched_names == ["mystery_kernel"]
    assert profile.busy_ms == 9e-5 and profile.idle_ms == 0
