"""Turning a growing list of generated ids into streamed text deltas.

Decoding one token at a time is wrong: a token may hold half of a multi-byte
character, and a SentencePiece token decodes differently at the start of a
text (its leading space is dropped). So each step decodes a short window of
recent tokens twice, with and without the new ones, and emits the difference
once it no longer ends in a half-finished character.
"""

from collections.abc import Iterable

from jserve.tokenizer.tokenizer import Tokenizer

# How many prompt tokens give the first generated token its left context.
_PROMPT_CONTEXT_TOKENS = 5
_REPLACEMENT_CHARACTER = "\ufffd"


class IncrementalDetokenizer:
    """Streams the text of generated ids.

    The deltas of `add` followed by `flush` concatenate to
    `tokenizer.decode(generated_ids)` (with a prompt, to the generated text as
    it reads after that prompt).
    """

    def __init__(
        self, tokenizer: Tokenizer, prompt_ids: list[int] | None = None, skip_special_tokens: bool = True
    ) -> None:
        self._decode = tokenizer.decoder(skip_special_tokens)  # called twice a token: bound once
        self._ids = list(prompt_ids or [])[-_PROMPT_CONTEXT_TOKENS:]
        # ids[window_start:emitted_end] were already turned into text;
        # text from window_start on is re-decoded to give later tokens context.
        self._window_start = 0
        self._emitted_end = len(self._ids)

    def add(self, new_ids: Iterable[int]) -> str:
        """The text that `new_ids` complete; may be empty while a character is unfinished."""
        self._ids.extend(new_ids)
        emitted, text = self._pending_text()
        if len(text) <= len(emitted) or text.endswith(_REPLACEMENT_CHARACTER):
            return ""
        return self._advance(emitted, text)

    def flush(self) -> str:
        """Whatever is still held back; call once the sequence has ended."""
        emitted, text = self._pending_text()
        return self._advance(emitted, text)

    def _pending_text(self) -> tuple[str, str]:
        window = self._ids[self._window_start :]
        emitted = self._decode(window[: self._emitted_end - self._window_start])
        return emitted, self._decode(window)

    def _advance(self, emitted: str, text: str) -> str:
        self._window_start, self._emitted_end = self._emitted_end, len(self._ids)
        return text[len(emitted) :]
