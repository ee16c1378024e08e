"""Tiny random-init checkpoints written with `transformers`, for tests that must not download anything."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import torch
import transformers
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

VOCAB_SIZE = 320
TRAINING_TEXT = [
    "The quick brown fox jumps over the lazy dog.",
    "Paris is the capital of France; Berlin is the capital of Germany.",
    "Once upon a time there was a tiny model that lived in a test suite.",
] * 20

# family -> transformers config class, and the variants the tests cover.
FAMILIES = {
    "llama": transformers.LlamaConfig,
    "mistral": transformers.MistralConfig,
    "qwen2": transformers.Qwen2Config,
    "qwen3": transformers.Qwen3Config,
}
VARIANTS = {
    "llama": ("llama", {}),
    "llama-tied-mqa": ("llama", {"tie_word_embeddings": True, "num_key_value_heads": 1}),
    "llama3-rope": (
        "llama",
        {"rope_parameters": {"rope_type": "llama3", "rope_theta": 500000.0, "factor": 8.0, "low_freq_factor": 1.0,
                             "high_freq_factor": 4.0, "original_max_position_embeddings": 64}},
    ),  # fmt: skip
    "llama-linear-rope": ("llama", {"rope_parameters": {"rope_type": "linear", "rope_theta": 10000.0, "factor": 4.0}}),
    "mistral-sliding": ("mistral", {"sliding_window": 12}),
    "qwen2": ("qwen2", {"tie_word_embeddings": True}),
    "qwen3": ("qwen3", {"head_dim": 32}),
}


def tiny_tokenizer() -> transformers.PreTrainedTokenizerFast:
    """A byte-level BPE with VOCAB_SIZE tokens, trained on a few sentences."""
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=VOCAB_SIZE, special_tokens=["<s>", "</s>"], initial_alphabet=pre_tokenizers.ByteLevel.alphabet()
    )
    tok.train_from_iterator(TRAINING_TEXT, trainer)
    return transformers.PreTrainedTokenizerFast(tokenizer_object=tok, bos_token="<s>", eos_token="</s>")


def tiny_config(family: str, **overrides) -> transformers.PretrainedConfig:
    fields = dict(
        vocab_size=VOCAB_SIZE,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=256,
        # Large enough that logits are decisive: greedy comparisons must not hinge on near-ties.
        initializer_range=0.3,
        bos_token_id=None,
        eos_token_id=None,
        pad_token_id=None,
    )
    fields.update(overrides)
    return FAMILIES[family](**fields)


def save_tiny_checkpoint(folder: Path, family: str, seed: int = 0, **overrides) -> transformers.PreTrainedModel:
    """Write config.json, model.safetensors and the tokenizer into `folder`; return the torch model."""
    torch.manual_seed(seed)
    model = transformers.AutoModelForCausalLM.from_config(tiny_config(family, **overrides), attn_implementation="eager")
    model = model.float().eval()
    model.save_pretrained(folder)
    tiny_tokenizer().save_pretrained(folder)
    return model


def reference_logits(model: transformers.PreTrainedModel, ids: list[int]) -> np.ndarray:
    with torch.no_grad():
        return model(torch.tensor([ids])).logits[0].float().numpy()


def reference_greedy(model: transformers.PreTrainedModel, ids: list[int], new_tokens: int) -> list[int]:
    with torch.no_grad():
        out = model.generate(torch.tensor([ids]), max_new_tokens=new_tokens, do_sample=False, eos_token_id=None)
    return out[0, len(ids) :].tolist()
