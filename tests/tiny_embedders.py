"""Tiny embedding checkpoints, saved by sentence-transformers itself: a random tiny decoder (tiny_models.py)
with Pooling, optional Dense and Normalize modules, in the layouts published embedders use."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

from sentence_transformers import SentenceTransformer
from sentence_transformers.sentence_transformer import modules as models

from tiny_models import save_tiny_checkpoint

LEGACY_KEYS = {"pooling_mode_cls_token": "cls", "pooling_mode_max_tokens": "max", "pooling_mode_mean_tokens": "mean",
               "pooling_mode_mean_sqrt_len_tokens": "mean_sqrt_len_tokens",
               "pooling_mode_weightedmean_tokens": "weightedmean", "pooling_mode_lasttoken": "lasttoken"}  # fmt: skip
# Texts to embed; the last is longer than the engines' 32-token chunks.
TEXTS = [
    "The quick brown fox jumps over the lazy dog.",
    "Paris is the capital of France.",
    "hi",
    "Once upon a time there was a tiny model that lived in a test suite. " * 2,
]


def save_tiny_embedder(
    folder: Path,
    family: str = "qwen3",
    modes: str | tuple[str, ...] = "lasttoken",
    normalize: bool = True,
    dense: str | None = None,
    causal_lm_layout: bool = False,
    legacy_pooling_config: bool = False,
    prompts: dict[str, str] | None = None,
    default_prompt_name: str | None = None,
    matryoshka: list[int] | bool | None = None,
    chat_template: str | None = None,
    seed: int = 0,
) -> SentenceTransformer:
    """Write an embedder into `folder` and return the SentenceTransformer that reads it back.

    `dense`: a Dense layer to 16 dimensions with this torch activation ("Tanh", "Identity"). The model's
    weights are saved as the base model (no `model.` prefix, no head), or with `causal_lm_layout` as the whole
    causal LM. `legacy_pooling_config`: 1_Pooling/config.json in the older pooling_mode_*_tokens form.
    `matryoshka`: config.json's matryoshka_dimensions (a list) or is_matryoshka (True). `chat_template`: the
    tokenizer's, with which sentence-transformers sends each text as a user message through it."""
    base = folder.parent / f"{folder.name}-causal-lm"
    save_tiny_checkpoint(base, family, seed)
    if chat_template is not None:
        path = base / "tokenizer_config.json"
        path.write_text(json.dumps(json.loads(path.read_text()) | {"chat_template": chat_template}))
    transformer = models.Transformer(str(base))
    transformer.tokenizer.pad_token = transformer.tokenizer.eos_token  # (sentence-transformers pads batches)
    width = transformer.get_embedding_dimension()
    modules = [transformer, models.Pooling(width, pooling_mode=modes)]
    if dense is not None:
        modules.append(models.Dense(modules[-1].get_embedding_dimension(), 16,
                                    activation_function=getattr(__import__("torch").nn, dense)()))  # fmt: skip
    if normalize:
        modules.append(models.Normalize())
    SentenceTransformer(modules=modules, prompts=prompts, default_prompt_name=default_prompt_name).save(str(folder))
    if causal_lm_layout:
        for name in ("config.json", "model.safetensors"):
            shutil.copy(base / name, folder / name)
    if legacy_pooling_config:
        path = folder / "1_Pooling" / "config.json"
        config = json.loads(path.read_text())
        chosen = config.pop("pooling_mode")
        chosen = (chosen,) if isinstance(chosen, str) else tuple(chosen)
        config["word_embedding_dimension"] = config.pop("embedding_dimension")
        for key, mode in LEGACY_KEYS.items():
            config[key] = mode in chosen
        path.write_text(json.dumps(config))
    if matryoshka is not None:
        path = folder / "config.json"
        config = json.loads(path.read_text())
        config["matryoshka_dimensions" if isinstance(matryoshka, list) else "is_matryoshka"] = matryoshka
        path.write_text(json.dumps(config))
    return SentenceTransformer(str(folder), device="cpu")
