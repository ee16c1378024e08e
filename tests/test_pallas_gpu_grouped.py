"""The mixture of experts' grouped matmul on GPUs (pallas_kernels/gpu/grouped_matmul.py): against a per-group
reference in Pallas interpret mode, and what the model's grouped matmul lowers to where."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.experimental import pallas as pl

from jserve import SamplingParams
from jserve.models import moe
from jserve.models.grouped_matmul import grouped_matmul as model_grouped_matmul
from pallas_kernels.gpu.grouped_matmul import GroupedLaunch, find_visit, grouped_matmul, row_block, supports

from accelerators import lowering_for
from test_engine import prompts, tiny_llm, token_ids
from tiny_models import VARIANTS, assert_engine_idle, reference_greedy, save_tiny_checkpoint

TRITON_CALL = "__gpu$xla.gpu.triton"

# (rows, group sizes, row tile): rows past the groups' sum are padding
CASES = {
    "a lone decode, 8 of 128 experts": (8, "top8of128", 64),
    "tiles shared by groups, empty groups, padding": (70, [0, 17, 3, 0, 29, 5], 16),
    "every row in one group": (48, [0, 48, 0], 16),
    "fewer rows than a tile": (5, [2, 0, 1], 64),
    "padding only": (32, [0, 0, 0, 0], 16),
}


def group_sizes(spec, groups: int) -> np.ndarray:
    if spec == "top8of128":
        sizes = np.zeros(groups, np.int32)
        sizes[np.random.default_rng(0).choice(groups, 8, replace=False)] = 1
        return sizes
    return np.asarray(spec, np.int32)


def reference(x, w, sizes, scale=None) -> np.ndarray:
    """Each group's rows times its weight (dequantized), in float64; padding rows zero."""
    x, w = np.asarray(x, np.float64), np.asarray(w, np.float64)
    if scale is not None:
        w = w * np.asarray(scale, np.float64)[:, :, None]
    out = np.zeros((x.shape[0], w.shape[1]))
    start = 0
    for group, size in enumerate(sizes):
        out[start : start + size] = x[start : start + size] @ w[group].T
        start += size
    return out


def operands(rows: int, spec, dtype, in_features: int = 64, out_features: int = 48, seed: int = 0):
    groups = 128 if spec == "top8of128" else len(spec)
    keys = jax.random.split(jax.random.key(seed), 3)
    x = jax.random.normal(keys[0], (rows, in_features)).astype(dtype)
    if dtype == jnp.int8:  # int8 weights meet float32 rows
        x = x.astype(jnp.float32)
        w = jax.random.randint(keys[1], (groups, out_features, in_features), -127, 128).astype(jnp.int8)
        scale = jax.random.uniform(keys[2], (groups, out_features), minval=1e-3, maxval=1e-2)
    else:
        w = (0.1 * jax.random.normal(keys[1], (groups, out_features, in_features))).astype(dtype)
        scale = None
    return x, w, group_sizes(spec, groups), scale


@pytest.mark.parametrize("case", CASES)
@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16, jnp.int8])
def test_the_kernel_matches_each_groups_product_in_interpret_mode(case, dtype):
    rows, spec, block_m = CASES[case]
    x, w, sizes, scale = operands(rows, spec, dtype)
    out = grouped_matmul(x, w, jnp.asarray(sizes), scale, launch=GroupedLaunch(block_m=block_m), interpret=True)
    assert out.shape == (rows, w.shape[1]) and out.dtype == x.dtype
    expected = reference(x, w, sizes, scale)
    tolerance = 2e-2 if dtype == jnp.bfloat16 else 1e-5
    np.testing.assert_allclose(np.asarray(out, np.float64), expected, rtol=tolerance, atol=tolerance)
    padding = np.asarray(out[int(sizes.sum()) :], np.float32)
    assert (padding == 0).all()  # written, as zeros: not left as whatever the buffer held


@pytest.mark.parametrize("case", CASES)
@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16, jnp.int8])
@pytest.mark.parametrize("activation", ["silu", "gelu_tanh"])
def test_the_gated_kernel_gives_act_of_gate_times_up(case, dtype, activation):
    """gated: the weight's outputs are an expert MLP's gate, then its up projection; the kernel stores
    act(gate) * up, half as wide (the padding rows' zeros too)."""
    rows, spec, block_m = CASES[case]
    x, w, sizes, scale = operands(rows, spec, dtype, out_features=64)
    launch = GroupedLaunch(block_m=block_m, block_n=16)  # (several output blocks of each half)
    out = grouped_matmul(x, w, jnp.asarray(sizes), scale, gated=activation, launch=launch, interpret=True)
    assert out.shape == (rows, 32) and out.dtype == x.dtype
    gate, up = np.split(reference(x, w, sizes, scale), 2, axis=-1)
    act = np.asarray(jax.nn.gelu(gate, approximate=True) if activation == "gelu_tanh" else jax.nn.silu(gate))
    tolerance = 2e-2 if dtype == jnp.bfloat16 else 1e-5
    np.testing.assert_allclose(np.asarray(out, np.float64), act * up, rtol=tolerance, atol=tolerance)
    assert (np.asarray(out[int(sizes.sum()) :], np.float32) == 0).all()


@pytest.mark.parametrize("sizes", [[0, 17, 3, 0, 29, 5], [16, 16, 0], [1] * 7, [0, 0, 0], [40]])
@pytest.mark.parametrize("block_m", [16, 32])
def test_every_row_is_stored_by_one_visit_of_its_own_group(sizes, block_m):
    """The programs' visits, as the kernel finds them, cover each row once: a group's rows by its visits, the
    padding rows past them by the padding group's. (Interpret mode runs programs one by one, so a row two
    programs stored would pass there; on a GPU it is a race.)"""
    groups = len(sizes)
    rows = (sum(sizes) // block_m + 1) * block_m  # some padding rows
    slots = np.zeros(pl.next_power_of_2(groups + 1), np.int32)
    slots[:groups] = sizes
    owner = np.repeat(np.arange(groups + 1), [*sizes, rows - sum(sizes)])
    stored = np.zeros(rows, np.int32)
    for visit in range(rows // block_m + groups):
        group, first_row, mine, count = find_visit(jnp.asarray(slots), visit, groups, block_m, rows)
        if visit < count:
            tile_rows = np.arange(first_row, first_row + block_m)[np.asarray(mine)]
            assert (owner[tile_rows] == int(group)).all()
            stored[tile_rows] += 1
    assert (stored == 1).all()


@pytest.mark.parametrize("launch", [GroupedLaunch(16, 16, 16, 2, 1), GroupedLaunch(128, 128, 256, 8, 3)], ids=str)
def test_launch_settings_change_no_result(launch):
    """Blocks from the smallest to larger than the weight (cut to what divides it)."""
    x, w, sizes, _ = operands(70, [0, 17, 3, 0, 29, 5], jnp.float32, in_features=128, out_features=64)
    out = grouped_matmul(x, w, jnp.asarray(sizes), launch=launch, interpret=True)
    np.testing.assert_allclose(np.asarray(out, np.float64), reference(x, w, sizes), rtol=1e-5, atol=1e-5)


def test_the_kernel_equals_the_cpu_tiled_walk_for_float_weights():
    """The GPU's kernel and the CPU's tiled walk (the model's grouped matmul on this host) agree."""
    x, w, sizes, _ = operands(70, CASES["tiles shared by groups, empty groups, padding"][1], jnp.float32)
    kernel = grouped_matmul(x, w, jnp.asarray(sizes), launch=GroupedLaunch(block_m=16), interpret=True)
    np.testing.assert_allclose(kernel, model_grouped_matmul(x, w, jnp.asarray(sizes)), rtol=1e-5, atol=1e-5)


def test_row_tiles_are_as_large_as_the_rows_allow():
    assert row_block(8, 64) == 16  # a lone decode of 8 experts: the smallest tile Triton's dot takes
    assert row_block(40, 64) == 64 and row_block(2048, 64) == 64 and row_block(2048, 128) == 128


def test_the_kernel_refuses_weights_its_blocks_do_not_divide():
    assert supports(in_features=2048, out_features=1536) and not supports(in_features=24, out_features=1536)
    assert supports(in_features=2048, out_features=1536, gated=True)  # halves of 768
    assert not supports(in_features=2048, out_features=48, gated=True)  # halves of 24
    with pytest.raises(ValueError, match="multiples of 16"):
        grouped_matmul(jnp.ones((4, 24)), jnp.ones((2, 32, 24)), jnp.asarray([2, 2]), interpret=True)


def lowered(fn, *args, platform="cuda") -> str:
    with lowering_for(platform):
        return jax.jit(fn).trace(*args).lower(lowering_platforms=(platform,)).as_text()


def shapes(rows: int, groups: int, out_features: int, in_features: int, weight_dtype=jnp.bfloat16):
    return (
        jax.ShapeDtypeStruct((rows, in_features), jnp.bfloat16),
        jax.ShapeDtypeStruct((groups, out_features, in_features), weight_dtype),
        jax.ShapeDtypeStruct((groups,), jnp.int32),
    )


@pytest.mark.parametrize("activation_group", [0, 32])  # int8, w8a8
def test_the_models_grouped_matmul_lowers_to_the_kernel_on_gpus(activation_group):
    """Float and int8 experts alike take the kernel on CUDA, never XLA's ragged_dot (a dense GEMM over every
    expert there); weights the kernel's blocks do not divide fall back (float: ragged_dot)."""
    text = lowered(model_grouped_matmul, *shapes(2048, 128, 1536, 2048))
    assert text.count(TRITON_CALL) == 1 and "ragged_dot" not in text
    scale = jax.ShapeDtypeStruct((128, 1536), jnp.float32)
    int8 = lambda x, w, g, s: model_grouped_matmul(x, w, g, s, activation_group)  # noqa: E731
    text = lowered(int8, *shapes(8, 128, 1536, 2048, jnp.int8), scale)
    assert text.count(TRITON_CALL) == 1 and "ragged_dot" not in text
    text = lowered(model_grouped_matmul, *shapes(64, 8, 1536, 24))
    assert TRITON_CALL not in text and "ragged_dot" in text


def test_other_platforms_keep_their_own_grouped_matmuls():
    """TPUs: XLA's ragged_dot (a grouped kernel there); this CPU: the tiled walk, no kernel."""
    assert "ragged_dot" in lowered(model_grouped_matmul, *shapes(2048, 128, 1536, 2048), platform="tpu")
    x, w, sizes, _ = operands(70, [0, 17, 3, 0, 29, 5], jnp.float32)
    cpu = jax.jit(model_grouped_matmul).trace(x, w, jnp.asarray(sizes)).lower().as_text()
    assert TRITON_CALL not in cpu and "ragged_dot" not in cpu


@pytest.mark.parametrize("variant", ["mixtral", "qwen3_moe"])
def test_an_engine_on_the_kernel_gives_transformers_greedy_tokens(tmp_path, monkeypatch, variant):
    """The experts' projections on the kernel (interpreted here; gate and up in one, gated) inside the engine:
    float32 greedy tokens of tiny Mixtral and Qwen3-MoE models, chunked prefills beside decodes, equal
    transformers'."""
    traced = []

    def on_the_kernel(x, w, group_sizes, scale=None, activation_group=0):
        traced.append(x.shape)
        return grouped_matmul(x, w, group_sizes, scale, interpret=True)

    def gated_on_the_kernel(x, w, group_sizes, scale=None, activation_group=0, gelu=False):
        traced.append(x.shape)
        activation = "gelu_tanh" if gelu else "silu"
        return grouped_matmul(x, w, group_sizes, scale, gated=activation, interpret=True)

    monkeypatch.setattr(moe, "grouped_matmul", on_the_kernel)
    monkeypatch.setattr(moe, "grouped_gated_matmul", gated_on_the_kernel)
    family, overrides = VARIANTS[variant]
    hf_model = save_tiny_checkpoint(tmp_path, family, **overrides)
    batch = prompts(4, seed=3, low=5, high=40)
    params = SamplingParams(temperature=0, max_tokens=6, ignore_eos=True)
    llm = tiny_llm(tmp_path, max_num_seqs=4, max_num_batched_tokens=32, max_model_len=64)
    got = token_ids(llm.generate(batch, params, use_tqdm=False))
    assert traced  # (the engine's step was traced here, with the kernel, not taken from a cache)
    assert_engine_idle(llm)
    assert got == [reference_greedy(hf_model, p, params.max_tokens) for p in batch]
