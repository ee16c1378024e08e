"""llguidance's view of jserve's tokenizer, built from the bytes of every token id.

Built from `Tokenizer.token_bytes`, so every way jserve loads a tokenizer (tokenizer.json, tokenizer.model,
a GGUF's own vocabulary) gives the grammar engine the same tokens the model samples. The model's
vocabulary may be padded past the tokenizer's: those ids have no bytes and are never allowed.
"""

from __future__ import annotations

from collections.abc import Collection

import llguidance as llg

from jserve.tokenizer import Tokenizer


class _Vocabulary:
    """What llguidance's TokenizerWrapper reads: the token bytes, EOS/BOS, special ids, and an encoder."""

    def __init__(self, tokenizer: Tokenizer, vocab_size: int, eos_id: int):
        tokens = tokenizer.token_bytes()[:vocab_size]
        self.tokens = tokens + [b""] * (vocab_size - len(tokens))
        self.eos_token_id = eos_id
        self.bos_token_id = tokenizer.bos_token_id
        self.special_token_ids = tokenizer.all_special_ids
        self._tokenizer = tokenizer

    def __call__(self, text: bytes) -> list[int]:
        return self._tokenizer.encode(text.decode("utf-8", errors="replace"), add_special_tokens=False)


def grammar_tokenizer(tokenizer: Tokenizer, vocab_size: int, eos_ids: Collection[int]) -> llg.LLTokenizer:
    """An LLTokenizer over the model's vocabulary whose end-of-sequence tokens are the engine's `eos_ids`:
    a grammar that may end allows exactly those."""
    eos = sorted(eos_ids)
    if not eos:
        raise ValueError("structured outputs need an end-of-sequence token, and this model has none")
    wrapper = llg.TokenizerWrapper(_Vocabulary(tokenizer, vocab_size, eos[0]))
    return llg.LLTokenizer(wrapper, n_vocab=vocab_size, eos_token=eos)
