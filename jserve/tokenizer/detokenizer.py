"""Turning a growing list of generated ids into streamed text deltas.

Decoding one token at a time is wrong in general: a token may hold half of a multi-byte character, and a
SentencePiece token decodes differently at the start of a text (its leading space is dropped). Byte-level
BPE is the exception that makes it easy: its text is its tokens' bytes joined, so `ByteStream` appends each
token's bytes to an incremental UTF-8 decoder. Other tokenizers get `DecodeWindow`, which decodes a short
window of recent tokens twice, with and without the new ones, and emits the difference once it no longer
ends in a half-finished character. Both hold back an unfinished character until it completes.
"""

from __future__ import annotations

import codecs
from typing import Protocol

from jserve.tokenizer.tokenizer import Tokenizer

# How many prompt tokens give the first generated token its left context.
_PROMPT_CONTEXT_TOKENS = 5
_REPLACEMENT_CHARACTER = "\ufffd"


class IncrementalDetokenizer(Protocol):
    """Streams the text of generated ids: the deltas of `add` followed by `flush` concatenate to
    `tokenizer.decode(generated_ids)` (with a prompt, to the generated text as it reads after that prompt)."""

    def add(self, token_id: int) -> str:
        """The text that `token_id` completes; may be empty while a character is unfinished."""

    def flush(self) -> str:
        """Whatever is still held back; call once the sequence has ended."""


def incremental_detokenizer(
    tokenizer: Tokenizer, prompt_ids: list[int] | None = None, skip_special_tokens: bool = True
) -> IncrementalDetokenizer:
    """A ByteStream where the tokenizer's decoding is joining bytes, else a DecodeWindow."""
    pieces = tokenizer.byte_pieces(skip_special_tokens)
    if pieces is not None:
        return ByteStream(pieces, tokenizer.byte_piece_texts(skip_special_tokens))
    return DecodeWindow(tokenizer, prompt_ids, skip_special_tokens)


class ByteStream:
    """Byte-level BPE: each id's bytes through a UTF-8 decoder that holds back an unfinished character (no left
    context needed). Most ids are whole characters, and with nothing held back their text is looked up, not
    decoded. Ids past the tokenizer's vocabulary (models pad theirs) have no text, as in `decode`."""

    __slots__ = ("_pieces", "_texts", "_size", "_held")  # one per running request, called every step

    def __init__(self, pieces: list[bytes], texts: list[str | None]) -> None:
        self._pieces, self._texts, self._size = pieces, texts, len(pieces)
        self._held = b""  # the first bytes of a character whose other bytes have not come yet

    def add(self, token_id: int) -> str:
        if token_id >= self._size:
            return ""
        if not self._held:
            text = self._texts[token_id]
            if text is not None:
                return text
        data = self._held + self._pieces[token_id]
        text, used = codecs.utf_8_decode(data, "replace", False)
        self._held = data[used:]
        return text

    def flush(self) -> str:
        text, self._held = codecs.utf_8_decode(self._held, "replace", True)[0], b""
        return text


class DecodeWindow:
    """Any tokenizer: re-decodes a window of recent ids (the first ones taking the prompt's last few)."""

    def __init__(
        self, tokenizer: Tokenizer, prompt_ids: list[int] | None = None, skip_special_tokens: bool = True
    ) -> None:
        self._decode = tokenizer.decoder(skip_special_tokens)  # called twice a token: bound once
        self._ids = list(prompt_ids or [])[-_PROMPT_CONTEXT_TOKENS:]
        # ids[window_start:emitted_end] were already turned into text;
        # text from window_start on is re-decoded to give later tokens context.
        self._window_start = 0
        self._emitted_end = len(self._ids)

    def add(self, token_id: int) -> str:
        self._ids.append(token_id)
        emitted, text = self._pending_text()
        if len(text) <= len(emitted) or text.endswith(_REPLACEMENT_CHARACTER):
            return ""
        return self._advance(emitted, text)

    def flush(self) -> str:
        emitted, text = self._pending_text()
        return self._advance(emitted, text)

    def _pending_text(self) -> tuple[str, str]:
        window = self._ids[self._window_start :]
        emitted = self._decode(window[: self._emitted_end - self._window_start])
        return emitted, self._decode(window)

    def _advance(self, emitted: str, text: str) -> str:
        self._window_start, self._emitted_end = self._emitted_end, len(self._ids)
        return text[len(emitted) :]
