"""Choosing the attention backend, and the engine running on the Pallas kernels (interpret mode on CPU)."""

import jax
import numpy as np
import pytest

from jserve import SamplingParams, cpu_kernels
from jserve.attention import CPU, REFERENCE, AttentionBackend, resolve_attention_backend
from jserve.loader import load_model
from pallas_kernels import mosaic_gpu

from test_engine import GREEDY, prompts, tiny_llm, token_ids
from tiny_models import (
    VARIANTS,
    assert_engine_idle,
    jserve_prompt_logits,
    reference_greedy,
    reference_logits,
    save_tiny_checkpoint,
)


@pytest.mark.parametrize(
    "name,platform,expected",
    [
        ("auto", "cpu", CPU),
        ("cpu", "cpu", CPU),
        ("auto", "gpu", AttentionBackend("pallas-gpu")),
        ("auto", "tpu", AttentionBackend("pallas-tpu")),
        ("reference", "gpu", REFERENCE),
        ("pallas", "cpu", AttentionBackend("pallas-gpu", interpret=True)),
        ("pallas-mosaic-gpu", "gpu", AttentionBackend("pallas-mosaic-gpu")),
        ("pallas-mosaic-gpu", "cpu", AttentionBackend("pallas-mosaic-gpu", interpret=True)),
    ],
)
def test_backend_resolution(name, platform, expected):
    assert resolve_attention_backend(name, platform) == expected


def test_unknown_backend_is_rejected():
    with pytest.raises(ValueError, match="attention_backend"):
        resolve_attention_backend("flash")
    with pytest.raises(ValueError, match="CPU only"):
        resolve_attention_backend("cpu", "gpu")
    with pytest.raises(ValueError, match="NVIDIA GPUs"):
        resolve_attention_backend("pallas-mosaic-gpu", "tpu")


def test_auto_falls_back_to_the_reference_without_a_compiler(monkeypatch):
    monkeypatch.setattr(cpu_kernels, "available", lambda: False)
    assert resolve_attention_backend("auto", "cpu") == REFERENCE


@pytest.mark.parametrize("variant", ["llama", "mistral-sliding", "qwen3", "llama-tied-mqa"])
def test_engine_on_pallas_kernels_matches_transformers_and_reference(tmp_path, variant):
    """Greedy tokens through the Pallas kernels equal transformers' and the reference backend's, with
    prompts long enough to be prefilled in chunks beside other requests' decodes."""
    family, overrides = VARIANTS[variant]
    hf_model = save_tiny_checkpoint(tmp_path, family, **overrides)
    batch = prompts(6, seed=11, low=5, high=90)
    params = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)
    pallas = tiny_llm(tmp_path, attention_backend="pallas", max_num_batched_tokens=32)
    assert pallas.engine.runner.attention == AttentionBackend("pallas-gpu", interpret=True)
    got = token_ids(pallas.generate(batch, params, use_tqdm=False))
    assert_engine_idle(pallas)
    reference = tiny_llm(tmp_path, attention_backend="reference", max_num_batched_tokens=32)
    assert got == token_ids(reference.generate(batch, params, use_tqdm=False))
    assert got == [reference_greedy(hf_model, p, params.max_tokens) for p in batch]


def test_pallas_output_does_not_depend_on_the_batch(tiny_llama_checkpoint):
    llm = tiny_llm(tiny_llama_checkpoint[0], attention_backend="pallas", enable_prefix_caching=True)
    probe = prompts(1, seed=1)[0]
    alone = token_ids(llm.generate([probe], GREEDY, use_tqdm=False))[0]
    crowd = prompts(11, seed=2, low=3, high=120)
    outputs = llm.generate(crowd[:5] + [probe] + crowd[5:], GREEDY, use_tqdm=False)
    assert outputs[5].outputs[0].token_ids == alone
    # Again, now reading the probe's prefix from the cache.
    assert token_ids(llm.generate([probe], GREEDY, use_tqdm=False))[0] == alone
    assert_engine_idle(llm)


@pytest.mark.parametrize("kernel", ["cpu", "pallas-gpu", "pallas-tpu", "reference"])
def test_model_logits_through_each_kernel_match_transformers(tmp_path, kernel):
    """Every kernel inside the model (Pallas ones in interpret mode): prompt logits within 1e-4 of transformers'."""
    hf_model = save_tiny_checkpoint(tmp_path, "qwen3", **VARIANTS["qwen3"][1])
    prompt = prompts(1, seed=5, low=40, high=41)[0]
    backend = AttentionBackend(kernel, interpret=kernel.startswith("pallas"))
    logits = jserve_prompt_logits(load_model(tmp_path, dtype="float32"), prompt, backend)
    np.testing.assert_allclose(logits, reference_logits(hf_model, prompt), atol=1e-4)


@pytest.mark.skipif(
    not mosaic_gpu.INTERPRETABLE,
    reason=f"Pallas' GPU interpreter runs the Mosaic GPU kernel from jax 0.11 on; this is jax {jax.__version__}",
)
def test_model_logits_through_the_mosaic_gpu_kernel_match_the_reference(tmp_path):
    """The Hopper kernel inside a bfloat16 model (interpreted): prompt logits as the reference backend's, to
    bfloat16's rounding (measured 0.117 apart, as the Triton kernel's; a wrong mask or scale is off by ~1)."""
    save_tiny_checkpoint(tmp_path, "qwen3", head_dim=64)  # a head_dim the kernel takes (else: Triton)
    model = load_model(tmp_path, dtype="bfloat16")
    prompt = prompts(1, seed=5, low=40, high=41)[0]
    logits = jserve_prompt_logits(model, prompt, AttentionBackend("pallas-mosaic-gpu", interpret=True))
    reference = jserve_prompt_logits(model, prompt)
    assert np.abs(reference).max() > 4  # logits of some size: the tolerance is four bfloat16 steps at 8-16
    np.testing.assert_allclose(logits, reference, atol=0.25)
