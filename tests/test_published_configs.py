"""Published checkpoints' config.json, as the hub serves them, read as transformers reads them.

For each file in published_configs/ (ORG--NAME.json: the hub checkpoint ORG/NAME's config.json): what
transformers builds from it (its modules, on the meta device, so a 27B costs nothing) and what jserve reads
from it agree per layer (attention window and scale, soft-caps, rope frequencies and their scale) and in the
model's layout (widths, heads, tied head, experts); and a shrunken copy (widths, vocabulary, windows and layer
count reduced, every other field as published) is token-exact with transformers, float32 greedy, on prompts
longer than its windows.
"""

import copy
import json
import logging
import re
from pathlib import Path

import numpy as np
import pytest
import torch
import transformers

from jserve import LLM, SamplingParams
from jserve.errors import ModelLoadError
from jserve.loader import load_model
from jserve.loader.hf_config import config_from_hf
from jserve.models.rotary import attention_factor, inverse_frequencies, sliding_layers_rope

from tiny_models import (
    VOCAB_SIZE,
    jserve_prompt_logits,
    reference_greedy,
    reference_logits,
    release_compiled,
    tiny_engine_args,
    tiny_kv_bytes,
    tiny_tokenizer,
)

PUBLISHED = Path(__file__).with_name("published_configs")
PUBLISHED_CONFIGS = {path.stem.replace("--", "/"): json.loads(path.read_text()) for path in PUBLISHED.glob("*.json")}
CHECKPOINTS = sorted(PUBLISHED_CONFIGS)
# Attention classes that pass config.sliding_window to every layer's attention (they keep no window of their own).
WINDOW_FROM_CONFIG = ("MistralAttention", "MixtralAttention", "Phi3Attention")
WINDOW = 8  # the shrunken copies' sliding window, in tokens
GREEDY = SamplingParams(temperature=0, max_tokens=16, ignore_eos=True)


def transformers_model(published: dict, device: str = "meta", seed: int = 0) -> transformers.PreTrainedModel:
    """transformers' model of a config.json: on the meta device (shapes only), or random-init on the CPU."""
    config = transformers.CONFIG_MAPPING[published["model_type"]].from_dict(copy.deepcopy(published))
    auto = transformers.AutoModelForImageTextToText if "text_config" in published else transformers.AutoModelForCausalLM
    torch.manual_seed(seed)
    with torch.device(device):
        model = auto.from_config(config, attn_implementation="eager")
    return model.float().eval()


def text_model(model: transformers.PreTrainedModel):
    inner = model.model
    return getattr(inner, "language_model", inner)


def transformers_facts(model: transformers.PreTrainedModel) -> dict:
    text = text_model(model)
    config = text.config
    layers = []
    rope = type(text.rotary_emb)(config)  # on the CPU: real buffers, the frequencies it rotates by
    for layer in text.layers:
        attn = layer.self_attn
        window = config.sliding_window if type(attn).__name__ in WINDOW_FROM_CONFIG else None
        kind = getattr(attn, "layer_type", None)
        prefix = f"{kind}_" if hasattr(rope, f"{kind}_inv_freq") else ""
        experts = getattr(layer.mlp, "experts", None)
        layers.append(
            dict(
                window=getattr(attn, "sliding_window", window),
                scale=float(attn.scaling),
                attn_softcap=getattr(attn, "attn_logit_softcapping", None),
                inv_freq=getattr(rope, f"{prefix}inv_freq").numpy().astype(np.float32).tolist(),
                rope_scale=float(getattr(rope, f"{prefix}attention_scaling")),
                experts=None
                if experts is None
                else (
                    experts.num_experts,
                    layer.mlp.gate.top_k,
                    experts.intermediate_dim,
                    getattr(layer.mlp.gate, "norm_topk_prob", True),  # Mixtral's router always renormalizes
                ),
            )
        )
    attn = text.layers[0].self_attn
    return dict(
        layers=layers,
        vocab_size=text.embed_tokens.num_embeddings,
        hidden_size=text.embed_tokens.embedding_dim,
        head_dim=attn.head_dim,
        num_heads=config.num_attention_heads,
        num_kv_heads=config.num_key_value_heads,
        rms_norm_eps=text.norm.variance_epsilon if hasattr(text.norm, "variance_epsilon") else text.norm.eps,
        tied_head=model.get_output_embeddings().weight is model.get_input_embeddings().weight,
        final_softcap=getattr(config, "final_logit_softcapping", None),
        qk_norm=hasattr(attn, "q_norm"),
    )


def jserve_facts(published: dict, name: str) -> dict:
    config = config_from_hf(copy.deepcopy(published), name)
    layers = []
    for i, window in enumerate(config.sliding_windows):
        rope = config if window is None else sliding_layers_rope(config)
        experts = (config.num_experts, config.num_experts_per_tok, config.moe_intermediate_size, config.norm_topk_prob)
        layers.append(
            dict(
                window=window,
                scale=(config.query_pre_attn_scalar or config.head_dim) ** -0.5,
                attn_softcap=config.attn_logit_softcapping,
                inv_freq=inverse_frequencies(rope).tolist(),
                rope_scale=attention_factor(rope),
                experts=experts if config.has_experts(i) else None,
            )
        )
    return dict(
        layers=layers,
        vocab_size=config.vocab_size,
        hidden_size=config.hidden_size,
        head_dim=config.head_dim,
        num_heads=config.num_heads,
        num_kv_heads=config.num_kv_heads,
        rms_norm_eps=config.rms_norm_eps,
        tied_head=config.tie_word_embeddings,
        final_softcap=config.final_logit_softcapping,
        qk_norm=config.qk_norm,
    )


def assert_same_facts(ours: dict, theirs: dict) -> None:
    ours, theirs = copy.deepcopy(ours), copy.deepcopy(theirs)
    for i, (mine, reference) in enumerate(zip(ours.pop("layers"), theirs.pop("layers"), strict=True)):
        np.testing.assert_allclose(mine.pop("inv_freq"), reference.pop("inv_freq"), rtol=1e-6, err_msg=f"layer {i}")
        assert mine.pop("scale") == pytest.approx(reference.pop("scale"), rel=1e-6), f"layer {i}"
        assert mine.pop("rope_scale") == pytest.approx(reference.pop("rope_scale"), rel=1e-6), f"layer {i}"
        assert mine == reference, f"layer {i}"
    assert ours.pop("rms_norm_eps") == pytest.approx(theirs.pop("rms_norm_eps"))
    assert ours == theirs


@pytest.mark.parametrize("name", CHECKPOINTS)
def test_config_reads_as_transformers_reads_it(name):
    published = PUBLISHED_CONFIGS[name]
    assert_same_facts(jserve_facts(published, name), transformers_facts(transformers_model(published)))


def _fewer(values: list, count: int) -> list:
    """`count` of the values, evenly spaced from first to last (a per-frequency list for fewer frequencies)."""
    return [values[round(i * (len(values) - 1) / max(count - 1, 1))] for i in range(count)]


def shrink(published: dict) -> dict:
    """A small copy of a published config: 64 wide, 4 heads of 16 dims, VOCAB_SIZE tokens, windows of WINDOW,
    the fewest layers that include a global one; every other field as published (those it leaves out still
    left out, so transformers' defaults apply to both)."""
    shrunk = copy.deepcopy(published)
    text = shrunk.get("text_config", shrunk)
    facts = transformers_facts(transformers_model(published))
    head_dim = 16
    kv = {facts["num_heads"]: 4, 1: 1}.get(facts["num_kv_heads"], 2)  # MHA, MQA, else grouped
    text.update(
        hidden_size=64, intermediate_size=96, num_attention_heads=4, num_key_value_heads=kv, vocab_size=VOCAB_SIZE
    )
    if "head_dim" in text or facts["head_dim"] != facts["hidden_size"] // facts["num_heads"]:
        text["head_dim"] = head_dim  # (where the family's default is not hidden / heads)
    if "query_pre_attn_scalar" in text:  # its ratio to head_dim, as published
        text["query_pre_attn_scalar"] = head_dim * text["query_pre_attn_scalar"] // facts["head_dim"]
    if text.get("sliding_window") is not None:
        text["sliding_window"] = WINDOW
    if "sliding_window_size" in text:
        text["sliding_window_size"] = WINDOW
    globals_at = [i for i, layer in enumerate(facts["layers"]) if layer["window"] is None]
    text["num_hidden_layers"] = max(2, globals_at[0] + 1 if globals_at else 2)
    if "layer_types" in text:
        text["layer_types"] = text["layer_types"][: text["num_hidden_layers"]]
    experts_key = "num_local_experts" if "num_local_experts" in text else "num_experts"
    if experts_key in text:
        text[experts_key] = min(text[experts_key], 8)
        text["num_experts_per_tok"] = min(text["num_experts_per_tok"], text[experts_key] // 2)
    if "moe_intermediate_size" in text:
        text["moe_intermediate_size"] = 32
    rope = text.get("rope_scaling") or {}
    rotary = int(head_dim * text.get("partial_rotary_factor", 1.0))
    for key in ("short_factor", "long_factor"):
        if key in rope:
            rope[key] = _fewer(rope[key], rotary // 2)
    for key in ("pad_token_id", "bos_token_id", "eos_token_id"):  # ids past the small vocabulary
        ids = text.get(key)
        if any(i >= VOCAB_SIZE for i in (ids if isinstance(ids, list) else [ids]) if i is not None):
            text[key] = None
    text["initializer_range"] = 0.3  # decisive logits: greedy comparisons must not hinge on near-ties
    if "vision_config" in shrunk:  # the smallest vision tower transformers builds: 2x2 patches, one layer
        shrunk["vision_config"].update(hidden_size=32, intermediate_size=64, num_hidden_layers=1,
                                       num_attention_heads=2, image_size=28, patch_size=14)  # fmt: skip
        shrunk["mm_tokens_per_image"] = 4
    return shrunk


@pytest.fixture(scope="module", params=CHECKPOINTS)
def shrunken(request, tmp_path_factory):
    """(published-form config, transformers model, folder) of a shrunken copy of a published checkpoint."""
    config = shrink(PUBLISHED_CONFIGS[request.param])
    folder = tmp_path_factory.mktemp(request.param.replace("/", "--"))
    model = transformers_model(config, device="cpu")
    model.save_pretrained(folder)
    (folder / "config.json").write_text(json.dumps(config))  # as published, not as transformers 5 writes it
    tiny_tokenizer().save_pretrained(folder)
    yield config, model, folder
    release_compiled()


def test_shrunken_copy_reads_as_transformers_reads_it(shrunken):
    config, model, folder = shrunken
    assert_same_facts(jserve_facts(config, folder.name), transformers_facts(model))


def test_shrunken_copy_is_token_exact(shrunken):
    config, model, folder = shrunken
    windows = [layer["window"] for layer in transformers_facts(model)["layers"]]
    rng = np.random.default_rng(3)
    prompts = [rng.integers(0, VOCAB_SIZE, length).tolist() for length in (6, 3 * WINDOW + 5, 40)]  # past the window
    expected = [reference_greedy(model, prompt, GREEDY.max_tokens) for prompt in prompts]
    # Decisive steps only (as in test_engine): a top-2 gap above 2e-4 cannot flip jserve's argmax.
    for prompt, reply in zip(prompts, expected, strict=True):
        top2 = np.sort(reference_logits(model, prompt + reply)[len(prompt) - 1 : -1], axis=-1)[:, -2:]
        assert (top2[:, 1] - top2[:, 0]).min() > 2e-4
    # (up to 6 layers of 4 KV heads: 6x the tiny models' KV bytes per page)
    llm = LLM.from_engine_args(tiny_engine_args(folder, max_model_len=128, kv_cache_memory=tiny_kv_bytes(64) * 6))
    outputs = llm.generate(prompts, GREEDY, use_tqdm=False)
    assert [o.outputs[0].token_ids for o in outputs] == expected, f"windows {windows}"


# A config.json naming nothing but its architecture: every field from the family's defaults.
ARCHITECTURES = {
    "llama": "LlamaForCausalLM",
    "mistral": "MistralForCausalLM",
    "qwen2": "Qwen2ForCausalLM",
    "qwen3": "Qwen3ForCausalLM",
    "qwen3_moe": "Qwen3MoeForCausalLM",
    "phi3": "Phi3ForCausalLM",
    "mixtral": "MixtralForCausalLM",
    "gemma2": "Gemma2ForCausalLM",
    "gemma3_text": "Gemma3ForCausalLM",
}


@pytest.mark.parametrize("model_type", sorted(ARCHITECTURES))
def test_fields_left_out_take_transformers_defaults(model_type):
    config = {"architectures": [ARCHITECTURES[model_type]], "model_type": model_type}
    assert_same_facts(jserve_facts(config, model_type), transformers_facts(transformers_model(config)))


def test_multimodal_checkpoint_serves_its_text_model(tmp_path, caplog):
    """Gemma 3's image-and-text checkpoints: the text model loads from its language_model tensors, and the log
    says the vision tower is not loaded."""
    config = shrink(PUBLISHED_CONFIGS["google/gemma-3-4b-it"])
    model = transformers_model(config, device="cpu")
    model.save_pretrained(tmp_path)
    (tmp_path / "config.json").write_text(json.dumps(config))
    tiny_tokenizer().save_pretrained(tmp_path)
    with caplog.at_level(logging.INFO, logger="jserve"):
        loaded = load_model(tmp_path, dtype="float32")
    assert "the vision tower is not loaded" in caplog.text
    assert re.search(r"\d+ vision tensors not loaded", caplog.text)
    ids = np.random.default_rng(4).integers(0, VOCAB_SIZE, 20).tolist()
    np.testing.assert_allclose(jserve_prompt_logits(loaded, ids), reference_logits(model, ids), atol=1e-4, rtol=0)


def test_other_multimodal_architectures_are_refused():
    config = {"architectures": ["LlavaForConditionalGeneration"], "model_type": "llava",
              "text_config": {"model_type": "llama"}, "vision_config": {}}  # fmt: skip
    with pytest.raises(ModelLoadError, match="multimodal architecture.*LlavaForConditionalGeneration"):
        config_from_hf(config, "config.json")
