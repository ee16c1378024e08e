"""The engine's whole step for a GPU, lowered on this CPU host (which needs no GPU).

An 8B-shaped Llama in bfloat16 goes through the runner's own jitted step and batch preparation with the
attention backend a GPU resolves to. Lowering for CUDA checks that every operation of the step has a CUDA
lowering, that the Pallas kernel is in it, and that nothing CPU-only (jserve's C++ kernels) is: this is the
program `benchmarks/roofline.py --model random:llama3-8b` runs on a GPU.
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


@pytest.fixture(scope="module")
def runner(tiny_llama_checkpoint):
    folder, _ = tiny_llama_checkpoint
    return LLM(str(folder), max_num_seqs=8, max_num_batched_tokens=64, max_model_len=256).engine.runner


@pytest.mark.parametrize("quantization", QUANTIZATIONS)
def test_an_8b_step_lowers_for_cuda(runner, quantization):
    config = MODEL_SHAPES["llama3-8b"]
    graphdef, abstract = abstract_model(config, jnp.bfloat16, quantization)
    params, params_def = jax.tree_util.tree_flatten(abstract)
    page_shape = (runner.config.num_pages, runner.config.page_size, config.num_kv_heads, config.head_dim)
    pages = jax.ShapeDtypeStruct(page_shape, jnp.bfloat16)
    kv_cache = (KVPages(pages, pages),) * config.num_layers
    penalties = jax.eval_shape(partial(init_penalty_state, runner.config.max_num_seqs, config.vocab_size))
    gpu = resolve_attention_backend("auto", platform="gpu")
    assert gpu.kernel == "pallas-gpu" and not gpu.interpret

    for bucket in (1, runner.config.token_buckets[-1]):  # a lone decode, and a full mixed step
        step = runner.prepare([], bucket)
        traced = runner.step_fn.trace(graphdef, gpu, params_def, params, kv_cache, penalties, runner.sampled, step)
        text = traced.lower(lowering_platforms=("cuda",)).as_text()
        assert "__gpu$xla.gpu.triton" in text
        assert "jserve_" not in text  # no C++ kernel (K/V write, int8 projection, attention) on a GPU
        if quantization != "none":
            assert "i8" in text  # the weights stay int8 on the device
