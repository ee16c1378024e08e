"""The engine's whole step for a GPU and a TPU, lowered on this CPU host (which needs neither).

An 8B-shaped Llama in bfloat16 goes through the runner's own jitted step and batch preparation with the
attention backend the accelerator resolves to. Lowering checks that every operation of the step has a
lowering there, that the Pallas kernel is in it, and that nothing CPU-only (jserve's C++ kernels) is: this
is the program `benchmarks/roofline.py --model random:llama3-8b` runs on a GPU.
"""

from functools import partial

import jax
import jax.numpy as jnp
import pytest

from jserve import LLM
from jserve.attention import KVPages, resolve_attention_backend
from jserve.engine.penalties import init_penalty_state
from jserve.loader.random_weights import MODEL_SHAPES
from jserve.loader.weights import abstract_model
from jserve.models.quantization import QUANTIZATIONS

from accelerators import lowering_for

# lowering platform -> (the platform the engine resolves its backend for, the Pallas kernel's custom call)
PLATFORMS = {"cuda": ("gpu", "__gpu$xla.gpu.triton"), "tpu": ("tpu", "tpu_custom_call")}


@pytest.fixture(scope="module")
def runner(tiny_llama_checkpoint):
    folder, _ = tiny_llama_checkpoint
    return LLM(str(folder), max_num_seqs=8, max_num_batched_tokens=64, max_model_len=256).engine.runner


@pytest.mark.parametrize("quantization", QUANTIZATIONS)
@pytest.mark.parametrize("platform", PLATFORMS)
def test_an_8b_step_lowers_for_the_accelerator(runner, platform, quantization):
    config = MODEL_SHAPES["llama3-8b"]
    graphdef, abstract = abstract_model(config, jnp.bfloat16, quantization)
    params, params_def = jax.tree_util.tree_flatten(abstract)
    page_shape = (runner.config.num_pages, runner.config.page_size, config.num_kv_heads, config.head_dim)
    pages = jax.ShapeDtypeStruct(page_shape, jnp.bfloat16)
    kv_cache = (KVPages(pages, pages),) * config.num_layers
    penalties = jax.eval_shape(partial(init_penalty_state, runner.config.max_num_seqs, config.vocab_size))
    backend_platform, kernel_call = PLATFORMS[platform]
    attention = resolve_attention_backend("auto", platform=backend_platform)
    assert attention.kernel == f"pallas-{backend_platform}" and not attention.interpret

    for bucket in (1, runner.config.token_buckets[-1]):  # a lone decode, and a full mixed step
        step = runner.prepare([], bucket)
        args = (graphdef, attention, params_def, params, kv_cache, penalties, runner.sampled, step)
        with lowering_for(platform):
            text = runner.step_fn.trace(*args).lower(lowering_platforms=(platform,)).as_text()
        assert kernel_call in text
        assert "jserve_" not in text  # no C++ kernel (K/V write, int8 projection, attention) off the CPU
        assert ("xi8>" in text) == (quantization != "none")  # int8 weights stay int8 on the device
