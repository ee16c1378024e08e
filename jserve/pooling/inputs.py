"""A text to embed, as the token ids sentence-transformers would give the model: the named prompt put before
it, lower-cased where the checkpoint says so, tokenized with the checkpoint's special tokens; or, for a
checkpoint saved with a message modality (sentence-transformers >= 6, a tokenizer with a chat template), sent
as a user message through the chat template, the prompt as a system message."""

from __future__ import annotations

from jserve.pooling.config import PoolingConfig
from jserve.tokenizer import Tokenizer


def embedding_input(tokenizer: Tokenizer, pooling: PoolingConfig, text: str, prompt: str = "") -> tuple[str, list[int]]:
    """(the text the model reads, its token ids)."""
    if pooling.message_format is None:
        text = prompt + text
        text = text.lower() if pooling.lower_case else text
        return text, tokenizer.encode(text)
    messages = ([{"role": "system", "content": prompt}] if prompt else []) + [{"role": "user", "content": text}]
    if pooling.message_format == "structured":
        messages = [{**m, "content": [{"type": "text", "text": m["content"]}]} for m in messages]
    return tokenizer.encode_chat(messages, add_generation_prompt=False)


def prompt_text(pooling: PoolingConfig, prompt_name: str | None) -> str:
    """The text of the model's prompt `prompt_name` (None: its default prompt, if it names one)."""
    name = prompt_name if prompt_name is not None else pooling.default_prompt_name
    if name is None:
        return ""
    if name not in pooling.prompts:
        raise ValueError(f"prompt_name {name!r} is not one of the model's prompts {sorted(pooling.prompts)}")
    return pooling.prompts[name]
