"""The tokenizer jserve uses for every checkpoint format.

Two backends do the actual work, both behind one small protocol:
`tokenizers` (a `tokenizer.json`, or a byte-level BPE rebuilt from a GGUF) and
`sentencepiece` (a `tokenizer.model`, or one rebuilt from a GGUF). `Tokenizer`
adds what a checkpoint's config says on top: special tokens, BOS/EOS rules
and the chat template.
"""

import json
import re
from collections.abc import Sequence
from dataclasses import dataclass, fields
from pathlib import Path
from typing import Any, Protocol

import gguf
from google.protobuf.message import DecodeError
from sentencepiece import SentencePieceProcessor
from sentencepiece import sentencepiece_model_pb2 as sp_model
from tokenizers import Tokenizer as HFTokenizer
from tokenizers import processors

from jserve.errors import ModelLoadError
from jserve.tokenizer.chat_template import render_chat_template
from jserve.tokenizer.gguf_tokenizer import read_gguf_tokenizer

TOKENIZER_JSON = "tokenizer.json"
SENTENCEPIECE_MODEL = "tokenizer.model"
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


@dataclass(frozen=True)
class AddedToken:
    """A token matched whole in the text rather than built from pieces."""

    content: str
    special: bool


class _Backend(Protocol):
    vocab_size: int
    special_ids: frozenset[int]

    def encode(self, text: str, add_special_tokens: bool) -> list[int]: ...

    def decode(self, ids: Sequence[int], skip_special_tokens: bool) -> str: ...

    def id_to_token(self, token_id: int) -> str | None: ...

    def token_to_id(self, token: str) -> int | None: ...

    def surround_with(self, prefix: list[int], suffix: list[int]) -> None:
        """Make `encode(..., add_special_tokens=True)` add these ids."""

    def save(self, folder: Path) -> dict[str, Any]:
        """Write the model file; return the config entries it relies on."""


class _TokenizersBackend:
    def __init__(self, model: HFTokenizer) -> None:
        # A tokenizer.json may ask for truncation or padding; a prompt must never be cut or padded.
        model.no_truncation()
        model.no_padding()
        self._model = model
        self.vocab_size = model.get_vocab_size(with_added_tokens=True)
        self.special_ids = frozenset(i for i, token in model.get_added_tokens_decoder().items() if token.special)

    @classmethod
    def load(cls, path: Path) -> "_TokenizersBackend":
        try:
            return cls(HFTokenizer.from_file(str(path)))
        except Exception as error:
            raise ModelLoadError(f"Could not load tokenizer file {path}: {error}") from error

    def encode(self, text: str, add_special_tokens: bool) -> list[int]:
        return self._model.encode(text, add_special_tokens=add_special_tokens).ids

    def decode(self, ids: Sequence[int], skip_special_tokens: bool) -> str:
        return self._model.decode(list(ids), skip_special_tokens=skip_special_tokens)

    def id_to_token(self, token_id: int) -> str | None:
        return self._model.id_to_token(token_id)

    def token_to_id(self, token: str) -> int | None:
        return self._model.token_to_id(token)

    def surround_with(self, prefix: list[int], suffix: list[int]) -> None:
        single = [self._model.id_to_token(i) for i in prefix] + ["$A"] + [self._model.id_to_token(i) for i in suffix]
        self._model.post_processor = processors.TemplateProcessing(
            single=single,
            pair=single + ["$B:1"],
            special_tokens=[(self._model.id_to_token(i), i) for i in {*prefix, *suffix}],
        )

    def save(self, folder: Path) -> dict[str, Any]:
        self._model.save(str(folder / TOKENIZER_JSON))
        return {}


class _SentencePieceBackend:
    """SentencePiece plus added tokens, which it cannot match in text itself.

    Text is cut at every control, unknown, user-defined or added token, and
    each piece in between is encoded on its own, so it gets SentencePiece's
    dummy-prefix space like llama.cpp gives it. Decoding mirrors that: every
    run of ordinary pieces drops its leading dummy space. A skipped special
    token does not end a run: "▁a </s> ▁b" decodes to "a b", as in transformers.
    """

    def __init__(self, proto: sp_model.ModelProto, added_tokens: dict[int, AddedToken]) -> None:
        self._proto = proto
        self._processor = SentencePieceProcessor(model_proto=proto.SerializeToString())
        self._added_tokens = added_tokens
        piece_type = sp_model.ModelProto.SentencePiece
        special_types = (piece_type.CONTROL, piece_type.UNKNOWN)
        whole_types = (*special_types, piece_type.USER_DEFINED)
        self._whole_tokens = {piece.piece: i for i, piece in enumerate(proto.pieces) if piece.type in whole_types}
        self._whole_tokens.update({token.content: i for i, token in added_tokens.items()})
        self._whole_tokens.pop("", None)
        # Longest first, so a token wins over any token it starts with.
        alternatives = sorted(self._whole_tokens, key=len, reverse=True)
        self._whole_pattern = re.compile("|".join(map(re.escape, alternatives))) if alternatives else None
        self._whole_ids = frozenset(self._whole_tokens.values())
        self.special_ids = frozenset(i for i, piece in enumerate(proto.pieces) if piece.type in special_types) | {
            i for i, token in added_tokens.items() if token.special
        }
        self.vocab_size = max([len(proto.pieces), *(i + 1 for i in added_tokens)])
        self._prefix: list[int] = []
        self._suffix: list[int] = []

    @classmethod
    def load(cls, path: Path, added_tokens: dict[int, AddedToken]) -> "_SentencePieceBackend":
        proto = sp_model.ModelProto()
        try:
            proto.ParseFromString(path.read_bytes())
        except DecodeError as error:
            raise ModelLoadError(f"Could not load SentencePiece model {path}: {error}") from error
        return cls(proto, added_tokens)

    def trained_special_tokens(self) -> SpecialTokens:
        """The special pieces the model was trained with (ids of -1 mean none)."""
        processor = self._processor
        ids = {
            "bos": processor.bos_id(),
            "eos": processor.eos_id(),
            "unk": processor.unk_id(),
            "pad": processor.pad_id(),
        }
        return SpecialTokens(**{name: processor.id_to_piece(i) if i >= 0 else None for name, i in ids.items()})

    def encode(self, text: str, add_special_tokens: bool) -> list[int]:
        ids: list[int] = []
        start = 0
        for match in self._whole_pattern.finditer(text) if self._whole_pattern else ():
            if match.start() > start:
                ids += self._processor.encode(text[start : match.start()])
            ids.append(self._whole_tokens[match.group()])
            start = match.end()
        if start < len(text):
            ids += self._processor.encode(text[start:])
        return self._prefix + ids + self._suffix if add_special_tokens else ids

    def decode(self, ids: Sequence[int], skip_special_tokens: bool) -> str:
        parts: list[str] = []
        run: list[int] = []
        for token_id in ids:
            # Models often pad their vocabulary; such ids have no text.
            if not 0 <= token_id < self.vocab_size or (skip_special_tokens and token_id in self.special_ids):
                continue
            if token_id in self._whole_ids:
                parts.append(self._processor.decode(run))
                parts.append(self.id_to_token(token_id))
                run = []
            else:
                run.append(token_id)
        parts.append(self._processor.decode(run))
        return "".join(parts)

    def id_to_token(self, token_id: int) -> str | None:
        if token_id in self._added_tokens:
            return self._added_tokens[token_id].content
        return self._proto.pieces[token_id].piece if 0 <= token_id < len(self._proto.pieces) else None

    def token_to_id(self, token: str) -> int | None:
        if token in self._whole_tokens:
            return self._whole_tokens[token]
        # SentencePiece answers the unknown id for any piece it lacks.
        token_id = self._processor.piece_to_id(token)
        return token_id if self._processor.id_to_piece(token_id) == token else None

    def surround_with(self, prefix: list[int], suffix: list[int]) -> None:
        self._prefix, self._suffix = prefix, suffix

    def save(self, folder: Path) -> dict[str, Any]:
        (folder / SENTENCEPIECE_MODEL).write_bytes(self._proto.SerializeToString())
        if not self._added_tokens:
            return {}
        entries = {
            str(i): {"content": token.content, "special": token.special} for i, token in self._added_tokens.items()
        }
        return {"added_tokens_decoder": entries}


class Tokenizer:
    """Text <-> token ids for one checkpoint, plus its chat template."""

    def __init__(
        self,
        backend: _Backend,
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

        backend: _Backend
        add_bos: bool | None = None
        add_eos: bool | None = None
        if (folder / TOKENIZER_JSON).is_file():
            # As in transformers, tokenizer.json's post-processor alone decides on BOS/EOS.
            backend = _TokenizersBackend.load(folder / TOKENIZER_JSON)
            special_tokens = SpecialTokens(**declared)
        elif (folder / SENTENCEPIECE_MODEL).is_file():
            backend = _SentencePieceBackend.load(folder / SENTENCEPIECE_MODEL, _added_tokens(config))
            trained = backend.trained_special_tokens()
            special_tokens = SpecialTokens(**{k: v or getattr(trained, k) for k, v in declared.items()})
            # LlamaTokenizer's defaults when the config is silent.
            add_bos = config.get("add_bos_token", True)
            add_eos = config.get("add_eos_token", False)
        else:
            raise ModelLoadError(
                f"No tokenizer in {folder}: expected {TOKENIZER_JSON} or {SENTENCEPIECE_MODEL} there"
            )
        return cls(backend, special_tokens, _chat_template(folder, config), add_bos, add_eos)

    @classmethod
    def from_gguf(cls, reader: gguf.GGUFReader) -> "Tokenizer":
        """Rebuild the tokenizer a GGUF file describes in its metadata."""
        data = read_gguf_tokenizer(reader)
        backend: _Backend
        if isinstance(data.model, HFTokenizer):
            backend = _TokenizersBackend(data.model)
        else:
            backend = _SentencePieceBackend(data.model, added_tokens={})

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

    def convert_ids_to_tokens(self, ids: Sequence[int]) -> list[str | None]:
        return [self._backend.id_to_token(i) for i in ids]

    def token_to_id(self, token: str) -> int | None:
        return self._backend.token_to_id(token)

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
