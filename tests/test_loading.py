"""Checkpoint sources agree with each other, and bad input fails with one clear error."""

import json
import logging
import shutil

import gguf
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx
from gguf.quants import dequantize, quantize

from jserve.cli import main as cli_main
from jserve.errors import ModelLoadError
from jserve.loader import load_model
from jserve.loader.gguf_source import open_gguf
from jserve.loader.random_weights import MODEL_SHAPES
from jserve.loader.weights import checkpoint_tensors, param_name
from jserve.tokenizer import Tokenizer

from tiny_models import VARIANTS, jserve_prompt_logits, save_tiny_checkpoint, write_gguf

PROMPT = list(range(3, 40))


@pytest.fixture(scope="module")
def llama_folder(tmp_path_factory):
    folder = tmp_path_factory.mktemp("llama-hf")
    return folder, save_tiny_checkpoint(folder, "llama")


def copy_checkpoint(src, dst):
    shutil.copytree(src, dst)
    return dst


def flat_params(model):
    return {
        jax.tree_util.keystr(path): np.asarray(leaf)
        for path, leaf in jax.tree_util.tree_flatten_with_path(model.params)[0]
    }


@pytest.mark.parametrize("variant", ["llama", "llama3-rope", "qwen2", "qwen3", "phi3"])
def test_gguf_and_safetensors_give_the_same_logits(tmp_path, variant):
    family, overrides = VARIANTS[variant]
    torch_model = save_tiny_checkpoint(tmp_path / "hf", family, **overrides)
    write_gguf(torch_model, tmp_path / "hf", tmp_path / "model.gguf", arch=family)  # llama: Q/K rows permuted
    from_hf, from_gguf = load_model(tmp_path / "hf", "float32"), load_model(tmp_path / "model.gguf", "float32")
    assert from_gguf.config.qk_norm == from_hf.config.qk_norm
    # llama3 rope arrives as scaling metadata from config.json but as rope_freqs divisors from GGUF.
    assert (from_gguf.config.rope_freq_factors is not None) == (variant == "llama3-rope")
    np.testing.assert_allclose(
        jserve_prompt_logits(from_gguf, PROMPT), jserve_prompt_logits(from_hf, PROMPT), atol=1e-5, rtol=0
    )
    assert from_gguf.tokenizer.encode("The quick brown fox") == from_hf.tokenizer.encode("The quick brown fox")


@pytest.mark.parametrize(
    "variant, arch, split_experts",
    [("mixtral", "llama", False), ("mixtral", "llama", True), ("qwen3_moe", "qwen3moe", False)],
    ids=["mixtral", "mixtral-expert-per-tensor", "qwen3_moe"],
)
def test_mixture_of_experts_gguf_gives_the_safetensors_logits(tmp_path, variant, arch, split_experts):
    """llama.cpp's expert tensors (stacked ffn_*_exps, or one per expert in older Mixtral files) and metadata
    (expert counts; which layers have experts, from their router tensors)."""
    family, overrides = VARIANTS[variant]
    torch_model = save_tiny_checkpoint(tmp_path / "hf", family, **overrides)
    write_gguf(torch_model, tmp_path / "hf", tmp_path / "model.gguf", arch=arch, split_experts=split_experts)
    from_hf, from_gguf = load_model(tmp_path / "hf", "float32"), load_model(tmp_path / "model.gguf", "float32")
    for name in ("family", "num_experts", "num_experts_per_tok", "moe_intermediate_size", "norm_topk_prob",
                 "moe_layers", "qk_norm"):  # fmt: skip
        assert getattr(from_gguf.config, name) == getattr(from_hf.config, name), name
    np.testing.assert_allclose(
        jserve_prompt_logits(from_gguf, PROMPT), jserve_prompt_logits(from_hf, PROMPT), atol=1e-5, rtol=0
    )


GEMMA3_ROPE = {"sliding_attention": {"rope_type": "default", "rope_theta": 10000.0},
               "full_attention": {"rope_type": "linear", "rope_theta": 1e6, "factor": 8.0}}  # fmt: skip


@pytest.mark.parametrize(
    "family, layout, fields",
    [
        # every 6th layer global (so both of these slide), a local rope base of 10000, attention by head_dim
        ("gemma3", {"layer_types": ["sliding_attention"] * 2, "rope_parameters": GEMMA3_ROPE,
                    "final_logit_softcapping": 30.0},
         ("sliding_windows", "rope_theta", "rope_scaling", "local_rope_theta", "query_pre_attn_scalar",
          "embedding_multiplier", "sandwich_norms", "hidden_activation", "qk_norm", "final_logit_softcapping")),
        # every 2nd layer global, soft-caps in the metadata
        ("gemma2", {"attn_logit_softcapping": 3.0},
         ("sliding_windows", "attn_logit_softcapping", "final_logit_softcapping", "query_pre_attn_scalar",
          "local_rope_theta", "qk_norm", "sandwich_norms")),
    ],
)  # fmt: skip
def test_gemma_gguf_gives_the_safetensors_logits(tmp_path, family, layout, fields):
    """llama.cpp's Gemma files carry (1 + w) norm scales and leave out what its loader fixes: checkpoints laid
    out as it assumes."""
    torch_model = save_tiny_checkpoint(tmp_path / "hf", family, head_dim=16, query_pre_attn_scalar=16,
                                       sliding_window=12, **layout)  # fmt: skip
    write_gguf(torch_model, tmp_path / "hf", tmp_path / "model.gguf", arch=family)
    from_hf, from_gguf = load_model(tmp_path / "hf", "float32"), load_model(tmp_path / "model.gguf", "float32")
    for name in fields:
        assert getattr(from_gguf.config, name) == getattr(from_hf.config, name), name
    np.testing.assert_allclose(
        jserve_prompt_logits(from_gguf, PROMPT), jserve_prompt_logits(from_hf, PROMPT), atol=1e-5, rtol=0
    )


@pytest.mark.parametrize("qtype", [gguf.GGMLQuantizationType.Q8_0, gguf.GGMLQuantizationType.Q4_0])
def test_quantized_gguf_tensors_are_dequantized(tmp_path, llama_folder, qtype):
    folder, torch_model = llama_folder
    write_gguf(torch_model, folder, tmp_path / "q.gguf", qtype=qtype)
    model = load_model(tmp_path / "q.gguf", "float32")
    w = torch_model.state_dict()["model.layers.0.mlp.up_proj.weight"].numpy()
    expected = dequantize(quantize(w, qtype), qtype)
    tensors = checkpoint_tensors(nnx.merge(model.graphdef, model.params))
    np.testing.assert_array_equal(tensors["layers.0.mlp.up_proj.weight"], expected)


def test_sharded_checkpoint_with_index(tmp_path, llama_folder):
    folder, torch_model = llama_folder
    sharded = tmp_path / "sharded"
    torch_model.save_pretrained(sharded, max_shard_size="40KB")
    shutil.copy(folder / "tokenizer.json", sharded)
    assert len(list(sharded.glob("*.safetensors"))) > 2 and (sharded / "model.safetensors.index.json").is_file()
    original, reloaded = load_model(folder, "float32"), load_model(sharded, "float32")
    np.testing.assert_array_equal(jserve_prompt_logits(reloaded, PROMPT), jserve_prompt_logits(original, PROMPT))

    next(sharded.glob("model-00002-*.safetensors")).unlink()
    with pytest.raises(ModelLoadError, match=r"index\.json lists shard files that are missing: model-00002-"):
        load_model(sharded)


def test_generation_config_eos_ids_are_stop_ids(tmp_path, llama_folder):
    folder = copy_checkpoint(llama_folder[0], tmp_path / "m")
    (folder / "generation_config.json").write_text(json.dumps({"eos_token_id": [7, 9]}))
    assert load_model(folder, "float32").config.eos_token_ids == (7, 9)


def test_bfloat16_loads_straight_to_bfloat16(llama_folder, caplog):
    folder, _ = llama_folder
    with caplog.at_level(logging.WARNING, logger="jserve"):
        model = load_model(folder, "bfloat16")
    # On a CPU the user is told what bfloat16 costs and what to pass instead.
    assert "--dtype bfloat16 on a CPU" in caplog.text and "--quantization int8" in caplog.text
    assert {leaf.dtype for leaf in jax.tree.leaves(model.params)} == {np.dtype("bfloat16")}
    # The float32 model's logits to bfloat16's precision: measured max |diff| 0.29 on logits up to 9.8.
    full = jserve_prompt_logits(load_model(folder, "float32"), PROMPT)
    np.testing.assert_allclose(jserve_prompt_logits(model, PROMPT), full, atol=0.05 * np.abs(full).max(), rtol=0)


def test_orbax_round_trip_gives_identical_params(tmp_path, llama_folder):
    folder, _ = llama_folder
    original = load_model(folder, "float32")
    assert cli_main(["convert", str(folder), str(tmp_path / "converted"), "--dtype", "float32"]) == 0
    restored = load_model(tmp_path / "converted", "float32")
    assert restored.source.kind == "orbax"
    assert restored.config == original.config
    a, b = flat_params(original), flat_params(restored)
    assert a.keys() == b.keys()
    for key in a:
        np.testing.assert_array_equal(a[key], b[key], err_msg=key)
    text = "Paris is the capital of France."
    assert restored.tokenizer.encode(text) == original.tokenizer.encode(text)


def test_convert_refuses_to_overwrite(tmp_path, llama_folder):
    folder, _ = llama_folder
    (tmp_path / "dst").mkdir()
    (tmp_path / "dst" / "keep.txt").write_text("mine")
    assert cli_main(["convert", str(folder), str(tmp_path / "dst")]) == 1
    assert [p.name for p in (tmp_path / "dst").iterdir()] == ["keep.txt"]


def test_hub_id_resolves_from_local_hf_cache(tmp_path, llama_folder, monkeypatch):
    folder, _ = llama_folder
    repo = tmp_path / "hub" / "models--acme--tiny-llama"
    copy_checkpoint(folder, repo / "snapshots" / "abc123")
    (repo / "refs").mkdir()
    (repo / "refs" / "main").write_text("abc123")
    monkeypatch.setenv("HF_HUB_CACHE", str(tmp_path / "hub"))
    assert load_model("acme/tiny-llama", "float32").config.family == "llama"  # no download: tests/test_hub.py


# --- bad input: one clear error each, naming the file and what was expected -------------------------


def test_missing_path(tmp_path):
    with pytest.raises(ModelLoadError, match="does not exist"):
        load_model(tmp_path / "nowhere")


def test_folder_without_a_model(tmp_path):
    with pytest.raises(ModelLoadError, match="no config.json"):
        load_model(tmp_path)


def test_corrupt_config(tmp_path, llama_folder):
    bad = copy_checkpoint(llama_folder[0], tmp_path / "m")
    (bad / "config.json").write_text("{not json")
    with pytest.raises(ModelLoadError, match=r"config\.json: not valid JSON"):
        load_model(bad)


def test_unknown_architecture(tmp_path, llama_folder):
    bad = copy_checkpoint(llama_folder[0], tmp_path / "m")
    config = json.loads((bad / "config.json").read_text())
    config.update(architectures=["GPT2LMHeadModel"], model_type="gpt2")
    (bad / "config.json").write_text(json.dumps(config))
    with pytest.raises(ModelLoadError, match="unsupported architecture.*LlamaForCausalLM.*Qwen3ForCausalLM"):
        load_model(bad)


def test_unsupported_rope_type(tmp_path, llama_folder):
    bad = copy_checkpoint(llama_folder[0], tmp_path / "m")
    config = json.loads((bad / "config.json").read_text())
    config["rope_parameters"] = {"rope_type": "yarn", "rope_theta": 10000.0, "factor": 4.0}
    (bad / "config.json").write_text(json.dumps(config))
    with pytest.raises(ModelLoadError, match="unsupported rope type 'yarn'"):
        load_model(bad)


def test_truncated_safetensors(tmp_path, llama_folder):
    bad = copy_checkpoint(llama_folder[0], tmp_path / "m")
    weights = bad / "model.safetensors"
    weights.write_bytes(weights.read_bytes()[:-1000])
    with pytest.raises(ModelLoadError, match=r"model\.safetensors: tensor .* runs past the end"):
        load_model(bad)


def test_shape_mismatch(tmp_path, llama_folder):
    bad = copy_checkpoint(llama_folder[0], tmp_path / "m")
    config = json.loads((bad / "config.json").read_text())
    config["intermediate_size"] = 96
    (bad / "config.json").write_text(json.dumps(config))
    with pytest.raises(ModelLoadError, match=r"mlp\..*_proj\.weight' has shape .* expected"):
        load_model(bad)


def test_missing_tensor(tmp_path, llama_folder):
    from safetensors.numpy import load_file, save_file

    bad = copy_checkpoint(llama_folder[0], tmp_path / "m")
    tensors = load_file(bad / "model.safetensors")
    del tensors["model.norm.weight"]
    save_file(tensors, bad / "model.safetensors")
    with pytest.raises(ModelLoadError, match="missing tensors norm.weight"):
        load_model(bad)


@pytest.mark.parametrize(
    "change, message",
    [("drop", "mlp.experts.up_proj.weight lacks experts 2"), ("extra", "names expert 4 of a model with 4 experts")],
)
def test_missing_or_extra_experts(tmp_path, change, message):
    from safetensors.numpy import load_file, save_file

    save_tiny_checkpoint(tmp_path, "mixtral", **VARIANTS["mixtral"][1])
    tensors = load_file(tmp_path / "model.safetensors")
    expert = "model.layers.1.block_sparse_moe.experts.2.w3.weight"
    if change == "drop":
        del tensors[expert]
    else:
        tensors[expert.replace(".2.", ".4.")] = tensors[expert]
    save_file(tensors, tmp_path / "model.safetensors")
    with pytest.raises(ModelLoadError, match=message):
        load_model(tmp_path)


def test_corrupt_gguf(tmp_path):
    path = tmp_path / "broken.gguf"
    path.write_bytes(b"GGUF" + bytes(range(256)) * 4)
    with pytest.raises(ModelLoadError, match="broken.gguf: not a readable GGUF"):
        load_model(path)


def test_unsupported_gguf_architecture(tmp_path):
    writer = gguf.GGUFWriter(str(tmp_path / "gpt2.gguf"), "gpt2")
    writer.add_block_count(1)
    writer.write_header_to_file(), writer.write_kv_data_to_file(), writer.write_tensors_to_file(), writer.close()
    with pytest.raises(ModelLoadError, match="unsupported GGUF architecture 'gpt2'; supported: llama"):
        load_model(tmp_path / "gpt2.gguf")


def test_unsupported_gguf_tensor_type(tmp_path, llama_folder):
    folder, torch_model = llama_folder
    write_gguf(torch_model, folder, tmp_path / "f64.gguf", float_dtype=np.float64)
    with pytest.raises(ModelLoadError, match="f64.gguf: tensor 'token_embd.weight' has unsupported GGUF type F64"):
        load_model(tmp_path / "f64.gguf")


def test_random_weights_of_a_named_shape():
    loaded = load_model("random:smollm2-135m", dtype="bfloat16")
    assert loaded.config == MODEL_SHAPES["smollm2-135m"]
    assert loaded.source.kind == "random"
    params = dict(jax.tree_util.tree_flatten_with_path(loaded.params)[0])
    norms = [leaf for path, leaf in params.items() if param_name(path).endswith("norm.weight")]
    weights = [leaf for path, leaf in params.items() if not param_name(path).endswith("norm.weight")]
    assert all(leaf.dtype == jnp.bfloat16 for leaf in params.values())
    assert all(bool((leaf == 1).all()) for leaf in norms)
    assert all(0.015 < float(jnp.std(leaf.astype(jnp.float32))) < 0.025 for leaf in weights)
    with pytest.raises(ModelLoadError, match="unknown model shape"):
        load_model("random:gpt-5")


def test_random_weights_need_only_the_default_tokenizer_folder(tmp_path, monkeypatch, smollm2_gguf_path):
    """The first load writes the default model's tokenizer into the cache as a folder; a cache holding only that
    folder (as on a GPU machine the 94 MB GGUF does not travel to) then serves random-weight models."""
    monkeypatch.setenv("JSERVE_CACHE", str(tmp_path))
    (tmp_path / smollm2_gguf_path.name).symlink_to(smollm2_gguf_path)
    reference = Tokenizer.from_gguf(open_gguf(smollm2_gguf_path))
    assert load_model("random:smollm2-135m").tokenizer.encode("Hello there") == reference.encode("Hello there")
    (tmp_path / smollm2_gguf_path.name).unlink()
    tokenizer = load_model("random:smollm2-135m").tokenizer
    text = "<|im_start|>user\nWhat is 2+2? ünïcödé<|im_end|>"
    assert tokenizer.encode(text) == reference.encode(text)
    assert tokenizer.chat_template == reference.chat_template
    assert tokenizer.eos_token_id == reference.eos_token_id


def test_our_gguf_reader_reads_what_the_librarys_reads(smollm2_gguf_path):
    """open_gguf replaces the gguf library's memmap slicing with plain ndarray slicing (3.3 s -> 0.7 s
    for SmolLM2): every field and tensor must come out the same."""
    ours, theirs = open_gguf(smollm2_gguf_path), gguf.GGUFReader(smollm2_gguf_path)
    assert list(ours.fields) == list(theirs.fields)
    for name, field in theirs.fields.items():
        assert ours.fields[name].types == field.types, name
        assert ours.fields[name].contents() == field.contents(), name
    assert [t.name for t in ours.tensors] == [t.name for t in theirs.tensors]
    for mine, reference in zip(ours.tensors, theirs.tensors, strict=True):
        assert (mine.tensor_type, list(mine.shape)) == (reference.tensor_type, list(reference.shape))
        np.testing.assert_array_equal(mine.data, reference.data)


@pytest.mark.parametrize("bars", [True, False])
def test_a_progress_bar_shows_only_where_asked(llama_folder, capsys, bars):
    """A notebook or the CLI sees the tensors load; a server (create_engine without bars) logs only the result."""
    folder, _ = llama_folder
    load_model(str(folder), progress_bars=bars)
    assert ("tensor/s" in capsys.readouterr().err) is bars
