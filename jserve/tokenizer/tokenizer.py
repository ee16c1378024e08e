"""The tokenizer jserve uses for every checkpoint format.

Two backends do the actual work, both behind one small protocol:
`tokenizers` (a `tokenizer.json`, or a byte-level BPE rebuilt from a GGUF) and
`sentencepiece` (a `tokenizer.model`, or one rebuilt from a GGUF). `Tokenizer`
adds what a checkpoint's config says on top: special tokens, BOS/EOS rules
and the chat template.
"""

import json
from collections.abc import Callable, Sequence
from dataclasses import dataclass, fields
from pathlib import Path
from typing import Any

import gguf
from tokenizers import Tokenizer as HFTokenizer

from jserve.errors import ModelLoadError
from jserve.tokenizer.backends import (
    SENTENCEPIECE_MODEL,
    TOKENIZER_JSON,
    AddedToken,
    Backend,
    SentencePieceBackend,
    TokenizersBackend,
)
from jserve.tokenizer.chat_template import render_chat_template
from jserve.tokenizer.gguf_tokenizer import read_gguf_tokenizer

TOKENIZER_CONFIG = "tokenizer_config.json"
SPECIAL_TOKENS_MAP = "special_tokens_map.json"
CHAT_TEMPLATE_FILE = "chat_template.jinja"


@dataclass(frozen=True)
class SpecialTokens:
    """The text of the checkpoint's named special tokens."""

    bos: str | None = None
    eos: str | None = None
    unk: str | None = None
    pad: str | None = None

    def template_variables(self) -> dict[str, str]:
        """`bos_token` etc., only for tokens the checkpoint defines."""
        return {f"{field.name}_token": getattr(self, field.name) for field in fields(self) if getattr(self, field.name)}


class Tokenizer:
    """Text <-> token ids for one checkpoint, plus its chat template."""

    def __init__(
        self,
        backend: Backend,
        special_tokens: SpecialTokens,
        chat_template: str | None,
        add_bos_token: bool | None,
        add_eos_token: bool | None,
    ) -> None:
        """`add_bos_token`/`add_eos_token` of None leave BOS/EOS to the backend's own rules
        (a tokenizer.json post-processor); a bool on either replaces those rules."""
        self._backend = backend
        self.special_tokens = special_tokens
        self.chat_template = chat_template
        self._add_bos_token = add_bos_token
        self._add_eos_token = add_eos_token
        self._piece_texts: dict[bool, list[str | None] | None] = {}
        if add_bos_token is not None or add_eos_token is not None:
            backend.surround_with(
                [self.bos_token_id] if add_bos_token and self.bos_token_id is not None else [],
                [self.eos_token_id] if add_eos_token and self.eos_token_id is not None else [],
            )

    @classmethod
    def from_folder(cls, path: str | Path) -> "Tokenizer":
        """Load a Hugging Face tokenizer folder (tokenizer.json or tokenizer.model)."""
        folder = Path(path)
        config = _read_json(folder / TOKENIZER_CONFIG)
        # As in transformers, special_tokens_map.json wins over tokenizer_config.json.
        named = {**config, **_read_json(folder / SPECIAL_TOKENS_MAP)}
        declared = {field.name: _token_text(named.get(f"{field.name}_token")) for field in fields(SpecialTokens)}

        backend: Backend
        add_bos: bool | None = None
        add_eos: bool | None = None
        if (folder / TOKENIZER_JSON).is_file():
            # As in transformers, tokenizer.json's post-processor alone decides on BOS/EOS.
            backend = TokenizersBackend.load(folder / TOKENIZER_JSON)
            special_tokens = SpecialTokens(**declared)
        elif (folder / SENTENCEPIECE_MODEL).is_file():
            backend = SentencePieceBackend.load(folder / SENTENCEPIECE_MODEL, _added_tokens(config))
            trained = backend.trained_special_tokens()
            special_tokens = SpecialTokens(**{k: v or trained[k] for k, v in declared.items()})
            # LlamaTokenizer's defaults when the config is silent.
            add_bos = config.get("add_bos_token", True)
            add_eos = config.get("add_eos_token", False)
        else:
            raise ModelLoadError(f"No tokenizer in {folder}: expected {TOKENIZER_JSON} or {SENTENCEPIECE_MODEL} there")
        return cls(backend, special_tokens, _chat_template(folder, config), add_bos, add_eos)

    @classmethod
    def from_gguf(cls, reader: gguf.GGUFReader) -> "Tokenizer":
        """Rebuild the tokenizer a GGUF file describes in its metadata."""
        data = read_gguf_tokenizer(reader)
        backend: Backend
        if isinstance(data.model, HFTokenizer):
            backend = TokenizersBackend(data.model)
        else:
            backend = SentencePieceBackend(data.model, added_tokens={})

        def text_of(token_id: int | None) -> str | None:
            return data.tokens[token_id] if token_id is not None and 0 <= token_id < len(data.tokens) else None

        special_tokens = SpecialTokens(
            bos=text_of(data.bos_token_id),
            eos=text_of(data.eos_token_id),
            unk=text_of(data.unk_token_id),
            pad=text_of(data.pad_token_id),
        )
        return cls(backend, special_tokens, data.chat_template, data.add_bos_token, data.add_eos_token)

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        """Token ids of `text`; special tokens written in it map to their own ids.

        With `add_special_tokens`, BOS/EOS are added as the checkpoint asks.
        """
        return self._backend.encode(text, add_special_tokens)

    def decode(self, ids: Sequence[int], skip_special_tokens: bool = True) -> str:
        return self._backend.decode(ids, skip_special_tokens)

    def decoder(self, skip_special_tokens: bool = True) -> Callable[[list[int]], str]:
        """`decode` of a list with one setting, straight to the backend: for callers that decode every token."""
        return self._backend.decoder(skip_special_tokens)

    def byte_pieces(self, skip_special_tokens: bool = True) -> list[bytes] | None:
        """The bytes each id adds to a decoded text (empty for a skipped special token), when decoding is
        joining them and reading the result as UTF-8, as byte-level BPE's is; None for other tokenizers.
        Built once, on first use (a pass over the vocabulary)."""
        return self._backend.byte_pieces(skip_special_tokens)

    def byte_piece_texts(self, skip_special_tokens: bool = True) -> list[str | None] | None:
        """Each byte piece's text where the piece is whole UTF-8 characters by itself, else None (it ends inside
        a character, or holds bytes that are no UTF-8): what a stream holding no unfinished character adds for
        that id. Built once, with byte_pieces."""
        if skip_special_tokens not in self._piece_texts:
            pieces = self.byte_pieces(skip_special_tokens)
            self._piece_texts[skip_special_tokens] = None if pieces is None else list(map(_whole_text, pieces))
        return self._piece_texts[skip_special_tokens]

    def convert_ids_to_tokens(self, ids: Sequence[int]) -> list[str | None]:
        return [self._backend.id_to_token(i) for i in ids]

    def token_to_id(self, token: str) -> int | None:
        return self._backend.token_to_id(token)

    def token_bytes(self) -> list[bytes]:
        """The bytes each id stands for (what a grammar engine matches); special tokens start with 0xFF."""
        return self._backend.token_bytes()

    def apply_chat_template(
        self,
        messages: list[dict],
        add_generation_prompt: bool = True,
        tools: list[dict] | None = None,
        **kwargs: Any,
    ) -> str:
        """The prompt text for `messages`, rendered as transformers would."""
        if self.chat_template is None:
            raise ValueError("This tokenizer has no chat template, so chat messages cannot be turned into a prompt")
        return render_chat_template(
            self.chat_template,
            messages,
            add_generation_prompt=add_generation_prompt,
            special_tokens=self.special_tokens.template_variables(),
            tools=tools,
            **kwargs,
        )

    def encode_chat(
        self, messages: list[dict], add_generation_prompt: bool = True, **template_kwargs: Any
    ) -> tuple[str, list[int]]:
        """The prompt for `messages`: the chat template's text, and its ids. The ids are encoded without
        special tokens: the template writes any BOS itself, and a second one would change the prompt."""
        text = self.apply_chat_template(messages, add_generation_prompt, **template_kwargs)
        return text, self.encode(text, add_special_tokens=False)

    def save(self, folder: str | Path) -> None:
        """Write a folder that `Tokenizer.from_folder` loads back identically."""
        folder = Path(folder)
        folder.mkdir(parents=True, exist_ok=True)
        config: dict[str, Any] = {f"{name}_token": text for name, text in vars(self.special_tokens).items()}
        config.update(self._backend.save(folder))
        if self._add_bos_token is not None or self._add_eos_token is not None:
            config.update(add_bos_token=bool(self._add_bos_token), add_eos_token=bool(self._add_eos_token))
        if self.chat_template is not None:
            config["chat_template"] = self.chat_template
        (folder / TOKENIZER_CONFIG).write_text(json.dumps(config, ensure_ascii=False, indent=2), encoding="utf-8")

    @property
    def vocab_size(self) -> int:
        return self._backend.vocab_size

    @property
    def all_special_ids(self) -> list[int]:
        """The ids `decode(..., skip_special_tokens=True)` leaves out."""
        return sorted(self._backend.special_ids)

    @property
    def bos_token_id(self) -> int | None:
        return self._id_of(self.special_tokens.bos)

    @property
    def eos_token_id(self) -> int | None:
        return self._id_of(self.special_tokens.eos)

    @property
    def unk_token_id(self) -> int | None:
        return self._id_of(self.special_tokens.unk)

    @property
    def pad_token_id(self) -> int | None:
        return self._id_of(self.special_tokens.pad)

    def _id_of(self, token: str | None) -> int | None:
        return None if token is None else self._backend.token_to_id(token)


def _read_json(path: Path) -> dict[str, Any]:
    """The JSON object in `path`, or {} when the file is absent."""
    if not path.is_file():
        return {}
    try:
        return json.loads(path.read_text(encoding="utf-8"))
    except (json.JSONDecodeError, UnicodeDecodeError) as error:
        raise ModelLoadError(f"Could not parse {path}: {error}") from error


def _token_text(value: str | dict | None) -> str | None:
    # Configs write a special token either as its text or as a serialized AddedToken.
    return value.get("content") if isinstance(value, dict) else value


def _added_tokens(config: dict[str, Any]) -> dict[int, AddedToken]:
    return {
        int(token_id): AddedToken(content=entry["content"], special=bool(entry.get("special", False)))
        for token_id, entry in config.get("added_tokens_decoder", {}).items()
    }


def _chat_template(folder: Path, config: dict[str, Any]) -> str | None:
    if (folder / CHAT_TEMPLATE_FILE).is_file():
        return (folder / CHAT_TEMPLATE_FILE).read_text(encoding="utf-8")
    template = config.get("chat_template")
    if isinstance(template, list):
        # Several named templates: the one used for plain chat is "default".
        template = {entry["name"]: entry["template"] for entry in template}.get("default")
    return template


def _whole_text(piece: bytes) -> str | None:
    try:
        return piece.decode("utf-8")
    except UnicodeDecodeError:
        return None
