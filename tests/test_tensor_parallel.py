"""Tensor parallelism on several host CPU devices: the greedy tokens and logits of transformers (or of one
device), and each device holding its share of weights and KV. The model runs in a subprocess because the
device count must be set before jax is imported (this process has one CPU device)."""

import dataclasses
import json
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from jserve import LLM
from jserve.errors import ModelLoadError
from jserve.loader import load_model
from jserve.loader.random_weights import MODEL_SHAPES
from jserve.parallel import tensor_parallel_config

from tensor_parallel_worker import GREEDY, PROMPTS
from tiny_adapters import save_tiny_adapter
from tiny_models import VARIANTS, reference_greedy, reference_logits, save_tiny_checkpoint

WORKER = Path(__file__).with_name("tensor_parallel_worker.py")


def run_worker(
    model: str,
    sizes: list[int],
    quantization: str = "none",
    speculative: str = "none",
    expert_parallel: bool = False,
    update_from: str | None = None,
    embed: bool = False,
    lora: list[str] | None = None,
) -> dict:
    env = dict(os.environ, XLA_FLAGS="--xla_force_host_platform_device_count=8")
    args = [model, quantization, speculative, *map(str, sizes)] + (["--expert-parallel"] if expert_parallel else [])
    args += (["--update-from", update_from] if update_from else []) + (["--embed"] if embed else [])
    args += ["--lora", ",".join(lora)] if lora else []
    done = subprocess.run([sys.executable, str(WORKER), *args], env=env, capture_output=True, text=True, timeout=1200)
    assert done.returncode == 0, done.stderr[-3000:]
    return {int(tp): result for tp, result in json.loads(done.stdout).items()}


def check_sharded(results: dict, tokens: list[list[int]], logits, atol: float, replicated_weight_bytes: int) -> None:
    """Each size's greedy tokens and prompt logits are `tokens` and `logits`, and each device holds its share of
    the weights and of every KV page (against the model as loaded on one device)."""
    for tp, result in results.items():
        assert result["tokens"] == tokens, f"tp={tp}"
        np.testing.assert_allclose(result["logits"], logits, atol=atol, rtol=0, err_msg=f"tp={tp}")
        weights, kv = result["weight_bytes"][:tp], result["kv_bytes"][:tp]
        assert not any(result["weight_bytes"][tp:]) and not any(result["kv_bytes"][tp:])  # other devices idle
        # Each device: the replicated weights (embedding, norms) and its 1/tp of the rest (a bound: when KV
        # heads are replicated, k/v projections are repeated too).
        kv_heads, total_weights = result["unsharded"]["num_kv_heads"], result["unsharded"]["weight_bytes"]
        share = (total_weights - replicated_weight_bytes) * max(kv_heads, tp) / kv_heads / tp + replicated_weight_bytes
        assert all(w <= share * 1.01 for w in weights), (weights, share)
        # KV split by head (heads replicated up to tp when fewer), every page on every device.
        page_bytes = result["unsharded"]["kv_bytes_per_token"] * result["page_size"]
        page_bytes = page_bytes * max(kv_heads, tp) // kv_heads // tp
        assert all(k == result["num_pages"] * page_bytes for k in kv), (kv, page_bytes)
        assert result["kv_shard_shape"][2] == max(kv_heads, tp) // tp


# jserve's logits are transformers' to 1e-4 on one device (test_models.py); split projections sum their partial
# products in another order, float32 rounding carried through every layer (SmolLM2's 30: 1.4e-4 apart at TP 3
# through XLA's matmuls, without the C++ kernels).
ONE_DEVICE_ATOL = 3e-4
REFERENCE_ATOL = 1e-4 + ONE_DEVICE_ATOL


def reference_tokens(reference) -> list[list[int]]:
    """transformers' greedy tokens for the worker's prompts."""
    return [reference_greedy(reference, ids, GREEDY.max_tokens) for ids in PROMPTS]


def check_against_transformers(results: dict, reference, replicated_weight_bytes: int) -> None:
    logits = reference_logits(reference, PROMPTS[1])
    check_sharded(results, reference_tokens(reference), logits, REFERENCE_ATOL, replicated_weight_bytes)


@pytest.mark.parametrize("family", ["llama", "qwen3", "phi3", "gemma2", "gemma3", "mixtral", "qwen3_moe"])
def test_tiny_models_at_tp_2_and_4(tmp_path, family):
    """2 KV heads: split at TP 2, replicated to one per device at TP 4."""
    # longrope; Gemma's layout; experts (each split like a dense MLP)
    overrides = VARIANTS[family][1] if family in ("phi3", "gemma2", "gemma3", "mixtral", "qwen3_moe") else {}
    reference = save_tiny_checkpoint(tmp_path, family, **overrides)
    results = run_worker(str(tmp_path), [2, 4])
    assert results[4]["num_kv_heads"] == 4
    check_against_transformers(results, reference, replicated_weight_bytes=replicated_bytes(family))


def replicated_bytes(family: str) -> int:
    """The tiny models' replicated weights (bytes, float32): embedding table, norms, and routers."""
    vocab, hidden, layers = 320, 64, 2
    experts = {"mixtral": 4, "qwen3_moe": 6}.get(family, 0)
    routers = layers * experts * hidden * (1 if family == "mixtral" else 0.5)  # Qwen3-MoE's second layer is dense
    return int((vocab * hidden + 2 * 1024 + routers) * 4)


@pytest.mark.parametrize("family", ["mixtral", "qwen3_moe"])
def test_expert_parallel_gives_one_devices_tokens(tmp_path, family):
    """Whole experts per device (Mixtral 4 over 2 and 4 devices; Qwen3-MoE's 6 over 2, its dense layer
    tensor-parallel), greedy tokens and logits as transformers', each device holding its experts only."""
    reference = save_tiny_checkpoint(tmp_path, family, **VARIANTS[family][1])
    sizes = [2, 4] if family == "mixtral" else [2]
    results = run_worker(str(tmp_path), sizes, expert_parallel=True)
    check_against_transformers(results, reference, replicated_weight_bytes=replicated_bytes(family))


def test_int8_experts_at_expert_parallel_2(tmp_path):
    """int8 experts split by expert give one device's tokens (logits held as int8 at TP 2 is, above)."""
    save_tiny_checkpoint(tmp_path, "mixtral", **VARIANTS["mixtral"][1])
    results = run_worker(str(tmp_path), [1, 2], quantization="int8", expert_parallel=True)
    assert results[2]["tokens"] == results[1]["tokens"]
    one = np.asarray(results[1]["logits"])
    np.testing.assert_allclose(results[2]["logits"], one, atol=1e-3 * np.abs(one).max())
    assert max(results[2]["weight_bytes"][:2]) < 0.6 * results[1]["weight_bytes"][0]


def test_expert_parallel_needs_experts_that_split():
    mixtral = dataclasses.replace(MODEL_SHAPES["smollm2-135m"], family="mixtral", num_experts=6,
                                  num_experts_per_tok=2, moe_intermediate_size=1536)  # fmt: skip
    with pytest.raises(ModelLoadError, match="num_experts 6 does not split over tensor_parallel_size 4"):
        tensor_parallel_config(dataclasses.replace(mixtral, num_heads=8, num_kv_heads=4), 4, expert_parallel=True)
    with pytest.raises(ModelLoadError, match="needs a mixture-of-experts model"):
        tensor_parallel_config(MODEL_SHAPES["smollm2-135m"], 1, expert_parallel=True)


@pytest.mark.parametrize("method", ["ngram", "draft"])
def test_speculative_decoding_at_tp_2(tmp_path, method):
    """Verify rows sampled from vocabulary-parallel logits, and a draft model whose weights and pages are split
    like the target's: transformers' greedy tokens (one device's speculation: test_speculative*.py)."""
    reference = save_tiny_checkpoint(tmp_path, "llama")
    result = run_worker(str(tmp_path), [2], speculative=method)[2]
    assert result["tokens"] == reference_tokens(reference)
    assert result["draft_tokens"] > 0
    if method == "draft":  # the model as its own draft: every proposal is the target's token
        assert result["accepted_tokens"] == result["draft_tokens"]


def test_a_converted_folder_loads_sharded(tmp_path):
    """`jserve convert` writes the checkpoint's tensors (fused q/k/v split back into q, k and v), so its folder
    loads at any tensor-parallel size: qwen2's biased q/k/v with its 2 KV heads replicated over 4 devices."""
    reference = save_tiny_checkpoint(tmp_path / "hf", "qwen2")
    load_model(tmp_path / "hf", "float32").save_orbax(tmp_path / "converted")
    results = run_worker(str(tmp_path / "converted"), [4])
    assert results[4]["num_kv_heads"] == 4
    check_against_transformers(results, reference, replicated_weight_bytes=320 * 64 * 4 + 2 * 1024 * 4)


@pytest.mark.parametrize("quantization", ["int8", "w8a8"])
def test_int8_weights_at_tp_2(tmp_path, quantization):
    """int8 projections split like float ones (scales with their rows), so TP 2 gives one device's tokens.
    int8's row-parallel layers add int32 partial sums across devices (s32 all-reduces), and on jax 0.10 and
    0.11 its TP 2 logits equal TP 1's bit for bit (float32's differ by 1.4e-5). On jax 0.12 they differ by up
    to 6.4e-4 of a range of 9.4, tokens equal: some activation lands on the neighbouring fine digit (a step
    of max|x| / 127² of its row); computing the digits as x · (127 / m) instead of x / s did not change
    that. So int8 is held to 1e-3 of the range. w8a8 adds float partial sums (its XLA form is a float
    matmul of the rounded activations), and its one digit absorbs nothing: a last-bit difference can move
    a later activation across a digit's rounding edge, a step of 1/127 of its group's largest value, so
    its logits agree to about 1 % of their range (measured 0.09 of 9.5)."""
    save_tiny_checkpoint(tmp_path, "qwen3")
    results = run_worker(str(tmp_path), [1, 2], quantization=quantization)
    assert results[2]["tokens"] == results[1]["tokens"]
    one = np.asarray(results[1]["logits"])
    tolerance = (1e-3 if quantization == "int8" else 0.03) * np.abs(one).max()
    np.testing.assert_allclose(results[2]["logits"], one, atol=tolerance)
    assert max(results[2]["weight_bytes"][:2]) < 0.6 * results[1]["weight_bytes"][0]


def test_smollm2_at_tp_3():
    """SmolLM2-135M: 9 query / 3 KV heads over 3 devices; its tied embedding stays replicated."""
    results = run_worker("default", [1, 3])
    check_sharded(results, results[1]["tokens"], results[1]["logits"], ONE_DEVICE_ATOL,
                  replicated_weight_bytes=49152 * 576 * 4 + 61 * 576 * 4)  # fmt: skip


@pytest.mark.parametrize(
    "heads,kv_heads,tp,message",
    [(9, 3, 2, "num_heads 9"), (12, 3, 4, "num_kv_heads 3"), (8, 2, 3, "num_heads 8")],
)
def test_head_counts_that_do_not_split_are_an_error(heads, kv_heads, tp, message):
    config = dataclasses.replace(MODEL_SHAPES["smollm2-135m"], num_heads=heads, num_kv_heads=kv_heads)
    with pytest.raises(ModelLoadError, match=message):
        tensor_parallel_config(config, tp)


def test_new_weights_at_tp_2_and_4(tmp_path):
    """update_weights on a sharded engine: each device takes its share of the new weights (KV heads
    replicated at TP 4), and it decodes what one device loaded with them decodes (int8 engines re-quantize
    alike: test_weight_update)."""
    first, second = tmp_path / "first", tmp_path / "second"
    save_tiny_checkpoint(first, "llama")
    save_tiny_checkpoint(second, "llama", seed=1)
    results = run_worker(str(first), [2, 4], update_from=str(second))
    one = LLM(str(second), dtype="float32", max_model_len=256, max_num_seqs=8, max_num_batched_tokens=64,
              kv_cache_memory=48 << 20)  # fmt: skip
    expected = [o.outputs[0].token_ids for o in one.generate(PROMPTS, GREEDY, use_tqdm=False)]
    for tp, result in results.items():
        assert result["updated_tokens"] == expected, f"tp={tp}"
        assert result["updated_tokens"] != result["tokens"], f"tp={tp}: the checkpoints should decode apart"
        assert result["weights_as_files"], f"tp={tp}"


def test_lora_adapters_at_tp_2_and_4(tmp_path):
    """Adapters split like their projections (B by rows for q/k/v and gate/up, A by input features for o and
    down; KV heads replicated at 4): a batch mixing two adapters and the base decodes as transformers + PEFT
    does, tokens and logprobs."""
    base = save_tiny_checkpoint(tmp_path / "base", "llama")
    peft_models = [save_tiny_adapter(tmp_path / name, base, seed) for seed, name in enumerate("ab", start=1)]
    results = run_worker(str(tmp_path / "base"), [2, 4], lora=[str(tmp_path / "a"), str(tmp_path / "b")])
    models = [peft_models[0], peft_models[1], base, peft_models[0]]
    expected = [reference_greedy(model, ids, 12) for model, ids in zip(models, PROMPTS, strict=True)]
    for tp, result in results.items():
        assert result["tokens"] == expected, f"tp={tp}"
        for model, ids, tokens, got in zip(models, PROMPTS, expected, result["logprobs"], strict=True):
            logits = reference_logits(model, ids + tokens)[len(ids) - 1 : -1].astype(np.float64)
            log_softmax = logits - logits.max(-1, keepdims=True)
            log_softmax -= np.log(np.exp(log_softmax).sum(-1, keepdims=True))
            np.testing.assert_allclose(got, log_softmax[np.arange(len(tokens)), tokens], atol=3e-4, err_msg=f"tp={tp}")
        assert sum(1 for b in result["kv_bytes"] if b) == tp, f"tp={tp}"


def test_embeddings_at_tp_2_and_4(tmp_path):
    """An embedding engine split over 2 and 4 devices (KV heads replicated at 4) pools what one device does."""
    save_tiny_checkpoint(tmp_path, "llama")
    results = run_worker(str(tmp_path), [1, 2, 4], embed=True)
    for tp, result in results.items():
        np.testing.assert_allclose(result["embeddings"], results[1]["embeddings"], atol=2e-5, err_msg=f"tp={tp}")
        assert sum(1 for b in result["kv_bytes"] if b) == tp, f"tp={tp}: the KV cache spans {tp} devices"
