"""The engine's whole step for a GPU and a TPU, lowered on this CPU host (which needs neither).

An 8B-shaped Llama in bfloat16 goes through the runner's own jitted step and batch preparation with the
attention backend the accelerator resolves to (with draft-model speculation on, so the step's verify rows
and a 2-layer draft model's proposal loop are lowered too). Lowering checks that every operation of the step has a
lowering there, that the Pallas kernel is in it, and that nothing CPU-only (jserve's C++ kernels) is: this
is the program `benchmarks/roofline.py --model random:llama3-8b` runs on a GPU.
"""

import dataclasses
import re
from dataclasses import replace
from functools import partial

import jax
import jax.numpy as jnp
import pytest

from jserve import LLM
from jserve.attention import KVPages, resolve_attention_backend
from jserve.engine.penalties import init_penalty_state
from jserve.engine.sampler import full_bitmask
from jserve.engine.stages import DEVICE_DECIDES
from jserve.engine.step import init_sampled
from jserve.engine.step_packing import StepPacking
from jserve.loader.random_weights import MODEL_SHAPES
from jserve.loader.weights import abstract_model
from jserve.lora import AdapterSlots, SlotLayout
from jserve.parallel.partition import WeightPlacement
from jserve.spec_decode import Drafter

from accelerators import lowering_for

TRITON_CALL, MOSAIC_GPU_CALL = "__gpu$xla.gpu.triton", "stablehlo.custom_call @mosaic_gpu"
# lowering platform -> (the platform the engine resolves its backend for, the Pallas kernel's custom call)
PLATFORMS = {"cuda": ("gpu", TRITON_CALL), "tpu": ("tpu", "tpu_custom_call")}
INT8_MODES = ("none", "int8", "w8a8")  # (GGUF block weights run on CPUs only)


@pytest.fixture(scope="module")
def runner(tiny_llama_checkpoint):
    folder, _ = tiny_llama_checkpoint
    spec = {"model": str(folder), "num_speculative_tokens": 4}
    llm = LLM(str(folder), max_num_seqs=8, max_num_batched_tokens=64, max_model_len=256, speculative_config=spec)
    return llm.engine.runner


def lower_step(
    runner, platform: str, attention, quantization: str = "none", dtype=jnp.bfloat16, config=None, adapters=None
) -> list[str]:
    """The lowered text of the runner's step for an 8B-shaped Llama (or `config`): a lone decode, and a full
    mixed step. `adapters`: LoRA slots (a SlotLayout) the step reads."""
    config = config or MODEL_SHAPES["llama3-8b"]
    adapter_weights = None
    if adapters is not None:
        adapter_weights = jax.eval_shape(
            lambda: AdapterSlots(adapters, dtype, WeightPlacement.create(config, None)).weights
        )
    graphdef, abstract = abstract_model(config, dtype, quantization)
    params, params_def = jax.tree_util.tree_flatten(abstract)

    def kv_cache(num_layers: int) -> KVPages:
        page_shape = (num_layers * runner.config.num_pages, runner.config.page_size, config.num_kv_heads,
                      config.head_dim)  # fmt: skip
        pages = jax.ShapeDtypeStruct(page_shape, dtype)
        return KVPages(pages, pages, num_layers)

    draft_config = dataclasses.replace(
        config, num_layers=2, sliding_windows=config.sliding_windows[:2], moe_layers=config.moe_layers[:2]
    )
    draft_graphdef, draft_abstract = abstract_model(draft_config, dtype, quantization)
    draft_params, draft_def = jax.tree_util.tree_flatten(draft_abstract)
    drafter = Drafter(draft_graphdef, draft_def, config.vocab_size, runner.proposer.num_tokens)
    penalties = jax.eval_shape(partial(init_penalty_state, runner.config.max_num_seqs, config.vocab_size))
    sampled = jax.eval_shape(partial(init_sampled, runner.sampled.token_ids.shape[0], config.vocab_size))
    texts = []
    for bucket in (1, runner.config.token_buckets[-1]):
        step = runner.prepare([], bucket)  # the tiny model's batch: its token bitmask is resized to the 8B vocabulary
        bitmask = full_bitmask(step.sampling.token_bitmask.shape[0], config.vocab_size)
        verify_bitmask = full_bitmask(step.verify.token_bitmask.shape[0], config.vocab_size)
        step = replace(step, sampling=replace(step.sampling, token_bitmask=bitmask),
                       verify=replace(step.verify, token_bitmask=verify_bitmask))  # fmt: skip
        packing = StepPacking.of(step)
        # (every stage behind its conditional: both branches of each lowered)
        args = (graphdef, attention, params_def, drafter, packing, DEVICE_DECIDES, params, draft_params,
                adapter_weights, kv_cache(config.num_layers), kv_cache(2), penalties, sampled,
                packing.pack(step))  # fmt: skip
        with lowering_for(platform):
            texts.append(runner.step_fn.trace(*args).lower(lowering_platforms=(platform,)).as_text())
    return texts


@pytest.mark.parametrize("quantization", INT8_MODES)
@pytest.mark.parametrize("platform", PLATFORMS)
def test_an_8b_step_lowers_for_the_accelerator(runner, platform, quantization):
    backend_platform, kernel_call = PLATFORMS[platform]
    attention = resolve_attention_backend("auto", platform=backend_platform)
    assert attention.kernel == f"pallas-{backend_platform}" and not attention.interpret
    config = MODEL_SHAPES["llama3-8b"]
    for text in lower_step(runner, platform, attention, quantization):
        assert kernel_call in text
        assert "jserve_" not in text  # no C++ kernel (K/V write, int8 projection, attention) off the CPU
        assert ("xi8>" in text) == (quantization != "none")  # int8 weights stay int8 on the device
        # The K/V pages (the target's and the draft's) are donated: each aliases a result, which XLA can then
        # write in place instead of copying tens of gigabytes a step.
        main = re.search(r"func\.func public @main\((.*?)\) ->", text, re.S).group(1)
        page = f"x{runner.config.page_size}x{config.num_kv_heads}x{config.head_dim}x"
        pages = re.findall(rf"%arg\d+: tensor<\d+{page}[a-z0-9]+>( \{{[^}}]*\}})?", main)
        assert len(pages) == 4 and all("tf.aliasing_output" in attrs for attrs in pages)


@pytest.mark.parametrize("platform", PLATFORMS)
def test_an_8b_step_with_lora_adapters_lowers_for_the_accelerator(runner, platform):
    """Four rank-16 adapter slots on every projection: two dense matmuls each, in XLA; no C++ kernel."""
    backend_platform, kernel_call = PLATFORMS[platform]
    attention = resolve_attention_backend("auto", platform=backend_platform)
    layout = SlotLayout.of(MODEL_SHAPES["llama3-8b"], slots=4, rank=16)
    for text in lower_step(runner, platform, attention, adapters=layout):
        assert kernel_call in text and "jserve_" not in text
        assert "tensor<4x48x4096xbf16>" in text  # a layer's q/k/v slots: 4 × (3 pieces × rank 16) × hidden


@pytest.mark.parametrize("dtype,kernel_call", [(jnp.bfloat16, MOSAIC_GPU_CALL), (jnp.float32, TRITON_CALL)])
def test_the_mosaic_gpu_backend_lowers_its_kernel_or_falls_back_to_triton(runner, dtype, kernel_call):
    """bfloat16 pages take the Hopper kernel; float32 ones, which WGMMA cannot multiply exactly, the Triton one.
    (A lone decode's norms are Triton kernels either way: pallas_kernels/gpu/rms_norm.py.)"""
    attention = resolve_attention_backend("pallas-mosaic-gpu", platform="gpu")
    for text in lower_step(runner, "cuda", attention, dtype=dtype):
        assert kernel_call in text
        assert (MOSAIC_GPU_CALL in text) == (kernel_call == MOSAIC_GPU_CALL)
        assert ('name = "ragged_paged_attention' in text) == (kernel_call == TRITON_CALL)


@pytest.mark.parametrize("quantization", INT8_MODES)
@pytest.mark.parametrize("platform", PLATFORMS)
def test_a_mixture_of_experts_step_lowers_for_the_accelerator(runner, platform, quantization):
    """An 8B-shaped Mixtral-style model (8 experts, top 2): on GPUs every expert projection is the Pallas
    grouped matmul (XLA:GPU's ragged_dot would multiply every row by every expert), float or int8; on TPUs
    float experts run as XLA's ragged_dot, int8 ones as the tiled walk through int8 dots (the CPU's path);
    no C++ kernel either way."""
    moe = dataclasses.replace(MODEL_SHAPES["llama3-8b"], family="mixtral", num_experts=8, num_experts_per_tok=2,
                              moe_intermediate_size=14336)  # fmt: skip
    attention = resolve_attention_backend("auto", platform=PLATFORMS[platform][0])
    for text in lower_step(runner, platform, attention, quantization, config=moe):
        grouped_kernels = len(re.findall(r'name = "grouped_matmul"', text))
        if platform == "cuda":
            assert "ragged_dot" not in text
            assert grouped_kernels >= 2  # gate/up and down (the text holds each distinct kernel once)
        else:
            assert ("ragged_dot" in text) == (quantization == "none")
            assert grouped_kernels == 0
        assert "jserve_" not in text
