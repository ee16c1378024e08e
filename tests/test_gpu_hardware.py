"""The Pallas GPU kernels compiled for a real NVIDIA GPU, and the engine running on them.

The rest of the suite checks the kernels in interpret mode on CPU; these run only where JAX sees a GPU.
The suite defaults to CPU (conftest), so run them there with the GPU visible:

    JAX_PLATFORMS=cuda,cpu python -m pytest tests/test_gpu_hardware.py
"""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jserve import SamplingParams
from jserve.attention import AttentionBackend
from jserve.loader import load_model
from pallas_kernels import gpu, mosaic_gpu
from pallas_kernels.gpu.grouped_matmul import GroupedLaunch, grouped_matmul

from attention_cases import BATCHES, assert_matches_reference, make_case
from test_engine import prompts, tiny_llm, token_ids
from test_pallas_gpu import CASES as TRITON_CASES
from test_pallas_gpu import SMALL_BLOCKS
from test_pallas_gpu_grouped import CASES as GROUPED_CASES
from test_pallas_gpu_grouped import operands, reference
from test_pallas_mosaic_gpu import CASES as MOSAIC_CASES
from tiny_models import VARIANTS, assert_engine_idle, jserve_prompt_logits, reference_greedy, save_tiny_checkpoint

pytestmark = pytest.mark.skipif(
    jax.default_backend() != "gpu", reason="needs an NVIDIA GPU visible to JAX (JAX_PLATFORMS=cuda,cpu)"
)
HOPPER = jax.default_backend() == "gpu" and jax.devices()[0].compute_capability.startswith("9")
requires_hopper = pytest.mark.skipif(not HOPPER, reason="the Mosaic GPU kernel needs a Hopper GPU (sm_90)")


def _run_kernel(kernel, params: dict, **blocks):
    params = dict(params)
    dtype = params.get("dtype", "float32")
    case = make_case(BATCHES[params.pop("batch")], **params)
    # float32 reference dots on a GPU default to TF32; the kernels' float32 tolerance needs full precision.
    with jax.default_matmul_precision("highest"):
        out = kernel(*case.kernel_args(), scale=case.scale, sliding_window=case.sliding_window,
                     soft_cap=case.soft_cap, **blocks)  # fmt: skip
        assert_matches_reference(out, case, "bfloat16" if dtype == "float16" else dtype)


@pytest.mark.parametrize("blocks", [{}, SMALL_BLOCKS], ids=["default-blocks", "small-blocks"])
@pytest.mark.parametrize("name", TRITON_CASES)
def test_triton_kernel_matches_reference(name, blocks):
    _run_kernel(gpu.ragged_paged_attention, TRITON_CASES[name], **blocks)


@pytest.mark.parametrize("case", GROUPED_CASES)
@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16, jnp.int8])
@pytest.mark.parametrize("gated", [None, "silu"])
def test_grouped_matmul_kernel_matches_each_groups_product(case, dtype, gated):
    """Each group's product, or (gated) act(gate) * up of the weight's two halves."""
    rows, spec, block_m = GROUPED_CASES[case]
    x, w, sizes, scale = operands(rows, spec, dtype, out_features=64)
    with jax.default_matmul_precision("highest"):
        out = jax.jit(grouped_matmul, static_argnames=("launch", "gated"))(
            x, w, jnp.asarray(sizes), scale, gated=gated, launch=GroupedLaunch(block_m, block_n=16)
        )
    expected = reference(x, w, sizes, scale)
    if gated:
        gate, up = np.split(expected, 2, axis=-1)
        expected = np.asarray(jax.nn.silu(gate)) * up
    tolerance = 2e-2 if dtype == jnp.bfloat16 else 1e-5
    np.testing.assert_allclose(np.asarray(out, np.float64), expected, rtol=tolerance, atol=tolerance)
    assert (np.asarray(out[int(sizes.sum()) :], np.float32) == 0).all()


@requires_hopper
@pytest.mark.parametrize("blocks", [{}, dict(kv_splits=3)], ids=["default-blocks", "three-splits"])
@pytest.mark.parametrize("name", MOSAIC_CASES)
def test_mosaic_gpu_kernel_matches_reference(name, blocks):
    _run_kernel(mosaic_gpu.ragged_paged_attention, {"dtype": "bfloat16", **MOSAIC_CASES[name]}, **blocks)


@pytest.mark.parametrize("variant", ["llama", "mistral-sliding", "gemma2", "mixtral", "qwen3_moe"])
def test_engine_on_triton_kernel_matches_transformers(tmp_path, variant):
    """float32 greedy tokens on the GPU's Triton kernel equal transformers' (and the reference backend's),
    with chunked prefills beside decodes; and a prompt alone (one-token steps: the split-KV merge kernel and
    the single-row norm kernel) gives the tokens it gave in the batch. The mixtures of experts run their
    experts on the grouped matmul kernel."""
    family, overrides = VARIANTS[variant]
    hf_model = save_tiny_checkpoint(tmp_path, family, **overrides)
    batch = prompts(6, seed=11, low=5, high=90)
    params = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)
    with jax.default_matmul_precision("highest"):
        pallas = tiny_llm(tmp_path, attention_backend="pallas", max_num_batched_tokens=32)
        assert pallas.engine.runner.attention.kernel == "pallas-gpu"
        got = token_ids(pallas.generate(batch, params, use_tqdm=False))
        assert token_ids(pallas.generate(batch[:1], params, use_tqdm=False)) == got[:1]
        assert_engine_idle(pallas)
        reference = tiny_llm(tmp_path, attention_backend="reference", max_num_batched_tokens=32)
        assert got == token_ids(reference.generate(batch, params, use_tqdm=False))
    assert got == [reference_greedy(hf_model, p, params.max_tokens) for p in batch]


@requires_hopper
def test_mosaic_gpu_kernel_is_as_accurate_as_the_reference_in_bfloat16(tmp_path):
    """A bfloat16 model's logits through the Hopper kernel are as close to float32's as the reference
    backend's at bfloat16 (tiny random models have near-ties, so bfloat16 greedy tokens may differ between
    any two implementations: the error, not the tokens, is what to compare)."""
    save_tiny_checkpoint(tmp_path, "llama")
    prompt = prompts(1, seed=5, low=90, high=91)[0]
    with jax.default_matmul_precision("highest"):
        exact = jserve_prompt_logits(load_model(tmp_path, dtype="float32"), prompt)
    model = load_model(tmp_path, dtype="bfloat16")
    error = {
        kernel: np.abs(jserve_prompt_logits(model, prompt, AttentionBackend(kernel)) - exact).max()
        for kernel in ("reference", "pallas-gpu", "pallas-mosaic-gpu")
    }
    print(error)
    assert error["pallas-mosaic-gpu"] <= 2 * error["reference"], error
    assert error["pallas-gpu"] <= 2 * error["reference"], error
