"""LoRA adapters against transformers + PEFT (float32) on tiny random checkpoints of every family: each
request's greedy tokens are its adapter's (or the base's), whatever else shares its batch, however few
device slots there are, and whatever the prefix cache holds. Every engine runs with debug checks, so a
step that compiled after warm-up (adapters coming and going must not recompile anything) fails the test."""

import json
import shutil
from dataclasses import replace

import numpy as np
import pytest
from safetensors.numpy import load_file, save_file

from jserve import LoRARequest, SamplingParams, cpu_kernels
from jserve.errors import RequestError
from jserve.models.quantization import quantize_rows

from test_engine import prompts, tiny_llm
from tiny_adapters import save_tiny_adapter
from tiny_models import (
    VARIANTS,
    assert_engine_idle,
    reference_greedy,
    reference_logits,
    save_tiny_checkpoint,
    write_gguf,
)

FAMILIES = ["llama", "mistral-sliding", "qwen2", "qwen3", "phi3", "gemma2", "gemma3", "mixtral", "qwen3_moe"]
ATTENTION = ["q_proj", "k_proj", "v_proj", "o_proj"]
GREEDY = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)


def references(models, prompt_list, new_tokens=GREEDY.max_tokens):
    return [reference_greedy(model, ids, new_tokens) for model, ids in zip(models, prompt_list, strict=True)]


def token_ids(outputs):
    return [o.outputs[0].token_ids for o in outputs]


def adapter_set(root, variant):
    """A base checkpoint and two adapters: `a` rank 8 on every projection the family's adapters reach (the
    attention ones only for a mixture of experts), `b` rank 4 with rsLoRA on q and v (Phi-3: its fused qkv)."""
    family, overrides = VARIANTS[variant]
    base = save_tiny_checkpoint(root / "base", family, 0, **overrides)
    experts = family in ("mixtral", "qwen3_moe")
    a = save_tiny_adapter(root / "a", base, 1, modules=ATTENTION if experts else None)
    b = save_tiny_adapter(root / "b", base, 2, rank=4, use_rslora=True,
                          modules=["qkv_proj"] if family == "phi3" else ["q_proj", "v_proj"])  # fmt: skip
    return base, {"a": a, "b": b}


def lora(root, name, int_id=1):
    return LoRARequest(name, int_id, str(root / name))


def reference_log_softmax(model, prompt: list[int], tokens: list[int]) -> np.ndarray:
    """The reference's next-token log-probabilities [len(tokens), vocab] along `tokens` generated after `prompt`."""
    logits = reference_logits(model, prompt + tokens)[len(prompt) - 1 : -1].astype(np.float64)
    shifted = logits - logits.max(-1, keepdims=True)
    return shifted - np.log(np.exp(shifted).sum(-1, keepdims=True))


def top_logprobs(completion) -> tuple[np.ndarray, np.ndarray]:
    """(token ids [steps, k], logprobs [steps, k]) of a completion's top logprobs at each step."""
    ids = [sorted(entry) for entry in completion.logprobs]
    values = [[entry[t].logprob for t in row] for entry, row in zip(completion.logprobs, ids, strict=True)]
    return np.array(ids), np.array(values)


@pytest.mark.parametrize("variant", FAMILIES)
def test_each_request_gets_its_adapters_tokens_in_a_mixed_batch(tmp_path, variant):
    """Greedy tokens, and the top-3 logprobs at every step (which tell adapters apart where a tiny model's argmax
    does not: Gemma 2's soft-capped logits pick one token whatever the adapter)."""
    base, adapters = adapter_set(tmp_path, variant)
    llm = tiny_llm(tmp_path / "base", enable_lora=True, max_loras=2)
    batch = prompts(6, seed=3)
    names = ["a", "b", None, "a", None, "b"]
    params = replace(GREEDY, logprobs=3)
    outs = llm.generate(batch, params, use_tqdm=False, lora_request=[name and lora(tmp_path, name) for name in names])
    models = [adapters[name] if name else base for name in names]
    assert token_ids(outs) == references(models, batch)
    for model, ids, out in zip(models, batch, outs, strict=True):
        tokens = out.outputs[0].token_ids
        top, got = top_logprobs(out.outputs[0])
        steps = np.arange(len(tokens))[:, None]
        np.testing.assert_allclose(got, reference_log_softmax(model, ids, tokens)[steps, top], rtol=0, atol=2e-4)
        if model is not base:  # (by ten times the tolerance: the comparison above tells adapters apart)
            assert np.abs(reference_log_softmax(base, ids, tokens)[steps, top] - got).max() > 2e-3
    assert_engine_idle(llm)


@pytest.fixture(scope="module")
def llamas(tmp_path_factory):
    """A tiny Llama and three adapters (a: every projection, rank 8; b: q, v rank 4 rsLoRA; c: MLP only, rank 16
    under an alpha_pattern), with their PEFT models."""
    root = tmp_path_factory.mktemp("lora")
    base, adapters = adapter_set(root, "llama")
    adapters["c"] = save_tiny_adapter(root / "c", base, 3, rank=16, modules=["gate_proj", "up_proj", "down_proj"],
                                      alpha_pattern={"down_proj": 4})  # fmt: skip
    return root, base, adapters


@pytest.fixture(scope="module")
def one_slot(llamas):
    """An engine with one adapter slot: a batch of several adapters runs them in turns."""
    return tiny_llm(llamas[0] / "base", enable_lora=True, max_loras=1, max_lora_rank=16, max_cpu_loras=4,
                    enable_prefix_caching=True)  # fmt: skip


def test_a_batch_of_more_adapters_than_slots_takes_turns(llamas, one_slot):
    root, base, adapters = llamas
    batch = prompts(8, seed=4)
    names = ["a", "b", "c", None, "c", "a", None, "b"]
    loads = one_slot.engine.adapter_slots.loads
    outs = one_slot.generate(batch, GREEDY, use_tqdm=False, lora_request=[name and lora(root, name) for name in names])
    assert token_ids(outs) == references([adapters[name] if name else base for name in names], batch)
    assert one_slot.engine.adapter_slots.loads - loads >= 3  # every adapter went through the one slot
    assert_engine_idle(one_slot)


def test_mixed_batch_equals_each_request_alone(llamas):
    root, _, _ = llamas
    llm = tiny_llm(root / "base", enable_lora=True, max_loras=3, max_lora_rank=16)
    batch = prompts(8, seed=6, low=20, high=60)  # (prefill chunks of 64-token steps mix with decodes)
    names = ["a", None, "b", "c", "a", "c", None, "b"]
    together = token_ids(llm.generate(batch, GREEDY, use_tqdm=False,
                                      lora_request=[name and lora(root, name) for name in names]))  # fmt: skip
    alone = [token_ids(llm.generate([ids], GREEDY, use_tqdm=False, lora_request=name and lora(root, name)))[0]
             for ids, name in zip(batch, names, strict=True)]  # fmt: skip
    assert together == alone


def test_prefix_cache_is_shared_within_an_adapter_only(llamas, one_slot):
    root, base, adapters = llamas
    shared = prompts(1, seed=7, low=50, high=51)[0]  # three whole pages
    runs = [("a", shared + [5]), ("b", shared + [6]), (None, shared + [7]), ("a", shared + [8]), (None, shared + [9])]
    cached = []
    for name, ids in runs:
        out = one_slot.generate([ids], GREEDY, use_tqdm=False, lora_request=name and lora(root, name))[0]
        assert out.outputs[0].token_ids == references([adapters[name] if name else base], [ids])[0], name
        cached.append(out.num_cached_tokens)
    # Each namespace's first request computes the prefix; the second under the same adapter (or the base) finds it.
    assert cached[:3] == [0, 0, 0] and cached[3] >= 48 and cached[4] >= 48


def test_an_adapter_removed_while_queued_still_serves_its_requests(llamas, one_slot):
    root, _, adapters = llamas
    llm = one_slot
    llm.add_lora(LoRARequest("queued", 7, str(root / "a")))
    assert "queued" in llm.list_loras()
    ids = prompts(1, seed=8)[0]
    request_id = llm.engine.add_request(ids, GREEDY, lora_request=LoRARequest("queued"))
    llm.remove_lora("queued")
    with pytest.raises(RequestError, match="no adapter named 'queued' is loaded"):
        llm.generate([ids], GREEDY, use_tqdm=False, lora_request=LoRARequest("queued"))
    outs = {}
    while llm.engine.has_unfinished_requests():
        outs |= {out.request_id: out for out in llm.engine.step() if out.finished}
    assert outs[request_id].outputs[0].token_ids == references([adapters["a"]], [ids])[0]
    assert "queued" not in llm.list_loras()
    assert_engine_idle(llm)


def broken_adapter(root, source, name, config=None, tensors=None):
    """A copy of adapter `source` with its config updated by `config` and its tensors by `tensors(dict)`."""
    folder = root / name
    folder.mkdir()
    settings = json.loads((source / "adapter_config.json").read_text()) | (config or {})
    (folder / "adapter_config.json").write_text(json.dumps(settings))
    weights = load_file(source / "adapter_model.safetensors")
    save_file(tensors(weights) if tensors else weights, folder / "adapter_model.safetensors")
    return folder


def renamed(weights, old, new):
    return {name.replace(old, new): value for name, value in weights.items()}


BROKEN = {
    "dora": ({"use_dora": True}, None, "DoRA"),
    "ia3": ({"peft_type": "IA3"}, None, "LoRA adapters only"),
    "bias": ({"bias": "all"}, None, "bias 'none'"),
    "target": ({"target_modules": ["q_proj", "embed_tokens"]}, None, "unknown target modules embed_tokens"),
    "module": (None, lambda w: renamed(w, "self_attn.q_proj", "self_attn.q_norm"), "unknown target module 'q_norm'"),
    "embedding": (None, lambda w: w | {"base_model.model.lm_head.lora_A.weight": np.zeros((8, 64), np.float32)},
                  "not a LoRA weight of an attention or MLP projection"),
    "shape": (None, lambda w: {k: v[:, :32] if k.endswith("lora_A.weight") else v for k, v in w.items()},
              "do not fit the base model"),
    "layers": (None, lambda w: renamed(w, "layers.1.", "layers.7."), "the base model has 2 layers"),
}  # fmt: skip


@pytest.mark.parametrize("case", BROKEN)
def test_an_adapter_that_does_not_fit_is_refused_and_changes_nothing(llamas, one_slot, tmp_path, case):
    root, base, _ = llamas
    config, tensors, message = BROKEN[case]
    folder = broken_adapter(tmp_path, root / "a", case, config, tensors)
    ids = prompts(1, seed=9)[0]
    with pytest.raises(RequestError, match=message):
        one_slot.generate([ids, ids], GREEDY, use_tqdm=False, lora_request=[None, LoRARequest(case, 9, str(folder))])
    assert token_ids(one_slot.generate([ids], GREEDY, use_tqdm=False)) == references([base], [ids])
    assert case not in one_slot.list_loras()
    assert_engine_idle(one_slot)


def test_a_rank_above_the_limit_and_a_missing_folder_are_refused(llamas, one_slot, tmp_path):
    _, base, _ = llamas
    llm = one_slot
    save_tiny_adapter(tmp_path / "wide", base, 4, rank=32)
    with pytest.raises(RequestError, match="rank 32 is above --max-lora-rank 16"):
        llm.generate([[1, 2, 3]], GREEDY, use_tqdm=False, lora_request=lora(tmp_path, "wide"))
    with pytest.raises(RequestError, match="neither an adapter folder nor a hub id"):
        llm.generate([[1, 2, 3]], GREEDY, use_tqdm=False, lora_request=LoRARequest("x", 1, str(tmp_path / "none")))
    with pytest.raises(RequestError, match="has no adapter_config.json"):
        llm.generate([[1, 2, 3]], GREEDY, use_tqdm=False, lora_request=LoRARequest("x", 1, str(tmp_path)))
    assert_engine_idle(llm)


def test_an_engine_without_enable_lora_refuses_adapters(llamas):
    root, _, _ = llamas
    llm = tiny_llm(root / "base")
    with pytest.raises(RequestError, match="serves no LoRA adapters"):
        llm.generate([[1, 2, 3]], GREEDY, use_tqdm=False, lora_request=lora(root, "a"))
    with pytest.raises(ValueError, match="--lora-modules needs --enable-lora"):
        tiny_llm(root / "base", lora_modules=[f"a={root / 'a'}"])


def int8_rounded_checkpoint(source, folder):
    """A copy of a float checkpoint with every matrix rounded as --quantization int8 rounds it (per row)."""
    folder.mkdir()
    for path in source.iterdir():
        if path.name != "model.safetensors":
            shutil.copy(path, folder / path.name)
    weights = load_file(source / "model.safetensors")
    for name, w in weights.items():
        if w.ndim == 2:
            q, scale = quantize_rows(w)
            weights[name] = np.asarray(q, np.float32) * np.asarray(scale)[:, None]
    save_file(weights, folder / "model.safetensors")


def test_int8_base_takes_float_adapters(llamas, tmp_path):
    """int8 weights (float adapters on top) give the tokens of their float values with the same adapters."""
    root, _, _ = llamas
    int8_rounded_checkpoint(root / "base", tmp_path / "rounded")
    batch = prompts(4, seed=10)
    names = ["a", "c", None, "a"]
    outputs = {}
    for folder, quantization in ((root / "base", "int8"), (tmp_path / "rounded", "none")):
        llm = tiny_llm(folder, quantization=quantization, enable_lora=True, max_loras=2, max_lora_rank=16)
        outs = llm.generate(batch, GREEDY, use_tqdm=False, lora_request=[name and lora(root, name) for name in names])
        outputs[quantization] = token_ids(outs)
    assert outputs["int8"] == outputs["none"]


@pytest.mark.skipif(not cpu_kernels.available(), reason="GGUF blocks need jserve's C++ kernels (a compiler)")
def test_gguf_blocks_base_takes_float_adapters(llamas, tmp_path):
    """Q8_0 blocks kept as the file has them (the CPU kernel) against the same file dequantized: equal tokens."""
    import gguf

    root, base, _ = llamas
    write_gguf(base, root / "base", tmp_path / "model.gguf", qtype=gguf.GGMLQuantizationType.Q8_0)
    batch = prompts(4, seed=11)
    names = ["a", "b", None, "c"]
    outputs = {}
    for quantization in ("gguf", "none"):
        llm = tiny_llm(tmp_path / "model.gguf", quantization=quantization, enable_lora=True, max_loras=3,
                       max_lora_rank=16)  # fmt: skip
        outs = llm.generate(batch, GREEDY, use_tqdm=False, lora_request=[name and lora(root, name) for name in names])
        outputs[quantization] = token_ids(outs)
    assert outputs["gguf"] == outputs["none"]


@pytest.mark.skipif(not cpu_kernels.available(), reason="needs a C++ compiler to build jserve's kernels")
def test_the_cpu_kernel_adds_what_the_masked_matmuls_add():
    """The C++ kernel's products (each token's own slot, added in place) against XLA's masked matmuls, for a
    fused projection of three pieces, tokens of every slot, without one, and padding."""
    import jax
    import jax.numpy as jnp

    from jserve.models.low_rank import Delta, LowRank
    from jserve.models.norm import RMSNorm

    rng = np.random.default_rng(0)
    slots, rank, inputs, rows = 3, 8, 48, (40, 16, 16)
    weights = LowRank(jnp.asarray(rng.normal(size=(slots, 3 * rank, inputs)), jnp.float32),
                      tuple(jnp.asarray(rng.normal(size=(slots, rank, r)), jnp.float32) for r in rows))  # fmt: skip
    token_slots = jnp.asarray([0, 2, -1, 1, 2, 2, -1, 0, -1, -1], jnp.int32)
    x = jnp.asarray(rng.normal(size=(10, inputs)), jnp.float32)
    y = jnp.asarray(rng.normal(size=(10, sum(rows))), jnp.float32)
    norm = RMSNorm(inputs, eps=1e-5, dtype=jnp.float32)
    norm.weight.value = jnp.asarray(rng.normal(size=inputs), jnp.float32)

    def added(cpu_kernel: bool, layer_norm) -> jax.Array:
        return jax.jit(lambda y, x: Delta(weights, token_slots, cpu_kernel).add_to(y, x, layer_norm))(y, x)

    for layer_norm in (None, norm):  # (the kernel applies the norm the base projection's kernel applied)
        kernel, masked = added(True, layer_norm), added(False, layer_norm)
        np.testing.assert_allclose(np.asarray(kernel), np.asarray(masked), rtol=1e-5, atol=1e-4)
        np.testing.assert_array_equal(np.asarray(kernel)[[2, 6, 8, 9]], np.asarray(y)[[2, 6, 8, 9]])  # base rows
