"""Settings an accelerator cannot run are refused at start-up, checked here on CPU with the device's limits
passed in: the TPU kernel's SMEM, the Triton kernel's block shapes, and the memory a step needs beside
the KV cache."""

import dataclasses
import logging
import re

import jax.numpy as jnp
import numpy as np
import pytest

from jserve.engine.args import EngineArgs
from jserve.engine.config import (
    MEMORY_HEADROOM,
    DeviceLimits,
    GiB,
    free_device_memory,
    resolve_engine_config,
    step_workspace_bytes,
)
from jserve.loader.random_weights import MODEL_SHAPES
from pallas_kernels import gpu, tpu
from pallas_kernels.split_rows import DEFAULT_NUM_CORES, MAX_KV_SPLITS, decode_splits

from attention_cases import TOLERANCE, make_case
from test_engine import tiny_llm

LLAMA_8B = MODEL_SHAPES["llama3-8b"]
SMOLLM2 = MODEL_SHAPES["smollm2-135m"]
TPU_V5E = DeviceLimits("tpu", 16 * GiB, smem_bytes=1 << 20)
H100 = DeviceLimits("gpu", 79 * GiB)


def resolve(model, limits, **settings):
    return resolve_engine_config(EngineArgs(**settings), model, jnp.bfloat16, limits=limits)


def test_an_8b_llama_at_its_full_context_fits_a_tpu_cores_smem():
    """131072 tokens x 256 sequences: scalar-prefetching every page table would take 8 MiB of a 1 MiB SMEM;
    the kernel copies one row's table at a time, so the default settings start."""
    config = resolve(LLAMA_8B, TPU_V5E, kv_cache_memory=32 * GiB)
    assert (config.max_model_len, config.max_num_seqs, config.attention_backend) == (131072, 256, "auto")
    assert config.max_num_seqs * config.max_model_len // config.page_size * 4 > TPU_V5E.smem_bytes


def test_a_tpu_config_over_smem_is_refused_naming_values_that_fit():
    """A 16 KiB SMEM (TPU v2/v3): refused, and the max_model_len and max_num_seqs it names both start."""
    small_smem = dataclasses.replace(TPU_V5E, smem_bytes=16 << 10)
    settings = dict(max_model_len=65536, max_num_seqs=64, max_num_batched_tokens=256, kv_cache_memory=8 * GiB)
    with pytest.raises(ValueError, match="SMEM") as refused:
        resolve(LLAMA_8B, small_smem, **settings)
    fits = dict(re.findall(r"(max_model_len|max_num_seqs) <= (\d+)", str(refused.value)))
    assert set(fits) == {"max_model_len"}, refused.value  # fewer sequences cannot shrink one page table
    max_len = int(fits["max_model_len"])
    resolve(LLAMA_8B, small_smem, **(settings | {"max_model_len": max_len}))
    with pytest.raises(ValueError, match="SMEM"):
        resolve(LLAMA_8B, small_smem, **(settings | {"max_model_len": max_len + 16}))

    # Here the rows' metadata is what overflows: fewer sequence slots mean fewer rows.
    many_rows = settings | {"max_model_len": 4096, "max_num_batched_tokens": 8192, "max_num_seqs": 512}
    with pytest.raises(ValueError, match=r"max_num_seqs <= \d+") as refused:
        resolve(LLAMA_8B, small_smem, **many_rows)
    seqs = int(re.search(r"max_num_seqs <= (\d+)", str(refused.value)).group(1))
    resolve(LLAMA_8B, small_smem, **(many_rows | {"max_num_seqs": seqs}))
    with pytest.raises(ValueError, match="SMEM"):
        resolve(LLAMA_8B, small_smem, **(many_rows | {"max_num_seqs": seqs + 1}))


def test_smem_need_grows_with_one_table_not_with_every_sequences():
    one_seq, many_seqs = tpu.smem_bytes(256, 1, 8192), tpu.smem_bytes(256, 256, 8192)
    assert many_seqs - one_seq < 16 << 10  # row metadata only
    assert tpu.smem_bytes(256, 1, 8192 + 128) - one_seq == 2 * 128 * 4  # one more tile per table slot


@pytest.mark.parametrize("page_size", [16, 32])
def test_the_triton_kernel_takes_power_of_two_shapes(page_size):
    config = resolve(SMOLLM2, H100, page_size=page_size)
    assert config.attention_backend == "auto"


def test_a_page_size_triton_cannot_take_is_refused_naming_one_it_can():
    for backend in ("auto", "pallas", "pallas-mosaic-gpu"):
        with pytest.raises(ValueError, match="page_size 16 fits"):
            resolve(SMOLLM2, H100, page_size=24, attention_backend=backend)


def test_a_head_dim_triton_cannot_take_runs_the_reference_under_auto(caplog):
    model = dataclasses.replace(SMOLLM2, head_dim=80)  # e.g. a Phi-2's
    with caplog.at_level(logging.WARNING, logger="jserve"):
        assert resolve(model, H100).attention_backend == "reference"
    assert "head_dim 80" in caplog.text and "reference" in caplog.text
    with pytest.raises(ValueError, match="attention_backend 'reference'"):
        resolve(model, H100, attention_backend="pallas")


def test_mosaic_gpu_hands_triton_the_shapes_it_does_not_take():
    """head_dim 256 is not the Mosaic kernel's (64/128) but is Triton's, which runs it: accepted."""
    model = dataclasses.replace(SMOLLM2, head_dim=256)
    assert resolve(model, H100, attention_backend="pallas-mosaic-gpu").attention_backend == "pallas-mosaic-gpu"


def test_the_triton_kernel_refuses_a_shape_it_cannot_lower():
    case = make_case([(1, 8), (5, 0)], head_dim=24)
    with pytest.raises(ValueError, match="power of two"):
        gpu.ragged_paged_attention(*case.kernel_args(), scale=case.scale, interpret=True)


def test_the_kv_cache_leaves_the_largest_step_its_workspace():
    config = resolve(LLAMA_8B, H100)
    page_bytes = config.page_size * 2 * LLAMA_8B.num_layers * LLAMA_8B.num_kv_heads * LLAMA_8B.head_dim * 2
    workspace = step_workspace_bytes(LLAMA_8B, 16, 2048, 256, 256)
    assert workspace > 1 * GiB  # the [256, 128256] logits alone are 0.12 GiB per float32 copy
    kv_bytes = config.num_pages * page_bytes
    assert kv_bytes <= (1 - MEMORY_HEADROOM) * H100.memory - workspace < kv_bytes + page_bytes


def test_free_memory_too_small_for_one_sequence_says_what_was_set_aside():
    nearly_nothing = DeviceLimits("gpu", 2 * GiB)
    with pytest.raises(ValueError, match="set aside for the step of max_num_batched_tokens 2048"):
        resolve(LLAMA_8B, nearly_nothing, max_model_len=8192)


def test_an_explicit_kv_cache_that_squeezes_the_step_is_warned_about(caplog):
    with caplog.at_level(logging.WARNING, logger="jserve"):
        resolve(LLAMA_8B, H100, kv_cache_memory=78 * GiB)
    assert "warm-up may run out of memory" in caplog.text


def test_the_cpu_default_is_a_quarter_of_ram_up_to_4_gib():
    config = resolve(SMOLLM2, DeviceLimits("cpu", 8 * GiB), max_model_len=8192, max_num_seqs=256)
    page_bytes = 16 * 2 * SMOLLM2.num_layers * SMOLLM2.num_kv_heads * SMOLLM2.head_dim * 2
    assert config.num_pages == 2 * GiB // page_bytes


def test_the_workspace_bound_covers_every_compiled_steps_scratch(tiny_llama_checkpoint):
    """On CPU XLA reports each compiled step's temporary memory: the bound is above all of them."""
    llm = tiny_llm(tiny_llama_checkpoint[0], attention_backend="reference")
    runner, config = llm.engine.runner, llm.engine.runner.config
    for (bucket, _), executable in runner.executables.items():
        scratch = executable.memory_analysis().temp_size_in_bytes
        bound = step_workspace_bytes(
            runner.model.config, config.page_size, bucket, config.seq_bucket(bucket), config.max_num_seqs
        )
        assert scratch <= bound, (bucket, scratch, bound)


def test_decode_splits_follow_the_batch():
    assert decode_splits(1, 8, 132) == MAX_KV_SPLITS  # a lone decode spreads over the SMs
    assert decode_splits(4, 8, 132) == 9  # ceil(2 x 132 / 32) programs' worth
    assert decode_splits(256, 8, 132) == 1  # enough slots: no merge to pay for
    assert decode_splits(64, 2, 16) == 1


@pytest.mark.parametrize("num_seqs", [1, 3])
def test_the_triton_kernel_matches_the_reference_whatever_the_split(num_seqs):
    """Decodes of long contexts in steps of 1 and 3 sequence slots (32 and 22 splits by default; and one)."""
    case = make_case([(1, 700), (1, 333), (1, 1023)][:num_seqs], head_dim=16, seed=num_seqs, pad=False)
    assert decode_splits(num_seqs, 2, DEFAULT_NUM_CORES) > 1
    expected = np.asarray(case.reference())
    for kv_splits in (None, 1):
        out = gpu.ragged_paged_attention(*case.kernel_args(), scale=case.scale, interpret=True, kv_splits=kv_splits)
        np.testing.assert_allclose(np.asarray(out), expected, atol=TOLERANCE["float32"], rtol=TOLERANCE["float32"])


def test_the_kv_cache_fits_the_largest_free_block():
    """The cache is two large arrays (K and V, every layer's pages): where loading left holes, it is sized to the
    largest free block."""
    stats = {"bytes_limit": 70 * GiB, "bytes_in_use": 16 * GiB}
    assert free_device_memory(stats) == 54 * GiB
    assert free_device_memory({**stats, "largest_free_block_bytes": 50 * GiB}) == 50 * GiB
