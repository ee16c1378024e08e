"""The two engines behind `Tokenizer`: `tokenizers` (tokenizer.json, GGUF byte-level BPE) and `sentencepiece`."""

import functools
import json
import re
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Protocol

from google.protobuf.message import DecodeError
from sentencepiece import SentencePieceProcessor
from sentencepiece import sentencepiece_model_pb2 as sp_model
from tokenizers import Tokenizer as HFTokenizer
from tokenizers import processors

from jserve.errors import ModelLoadError
from jserve.tokenizer.token_bytes import byte_level_bytes, byte_level_piece, metaspace_bytes, special_bytes

TOKENIZER_JSON = "tokenizer.json"
SENTENCEPIECE_MODEL = "tokenizer.model"


@dataclass(frozen=True)
class AddedToken:
    """A token matched whole in the text rather than built from pieces."""

    content: str
    special: bool


class Backend(Protocol):
    vocab_size: int
    special_ids: frozenset[int]

    def encode(self, text: str, add_special_tokens: bool) -> list[int]: ...

    def decode(self, ids: Sequence[int], skip_special_tokens: bool) -> str: ...

    def decoder(self, skip_special_tokens: bool) -> Callable[[list[int]], str]:
        """`decode` for one setting, taking a list, with as little in between as the engine allows."""

    def byte_pieces(self, skip_special_tokens: bool) -> list[bytes] | None:
        """The bytes each id adds to a decoded text, where decoding is joining them and reading the result as
        UTF-8 (invalid bytes replaced) whatever the neighbours; None for tokenizers whose decoding is not."""

    def id_to_token(self, token_id: int) -> str | None: ...

    def token_to_id(self, token: str) -> int | None: ...

    def token_bytes(self) -> list[bytes]:
        """Every id's bytes (see token_bytes.py); special tokens marked, ids without a token empty."""

    def surround_with(self, prefix: list[int], suffix: list[int]) -> None:
        """Make `encode(..., add_special_tokens=True)` add these ids."""

    def save(self, folder: Path) -> dict[str, Any]:
        """Write the model file; return the config entries it relies on."""


class TokenizersBackend:
    def __init__(self, model: HFTokenizer) -> None:
        # A tokenizer.json may ask for truncation or padding; a prompt must never be cut or padded.
        model.no_truncation()
        model.no_padding()
        self._model = model
        self.vocab_size = model.get_vocab_size(with_added_tokens=True)
        self.special_ids = frozenset(i for i, token in model.get_added_tokens_decoder().items() if token.special)

    @classmethod
    def load(cls, path: Path) -> "TokenizersBackend":
        try:
            return cls(HFTokenizer.from_file(str(path)))
        except Exception as error:
            raise ModelLoadError(f"Could not load tokenizer file {path}: {error}") from error

    def encode(self, text: str, add_special_tokens: bool) -> list[int]:
        return self._model.encode(text, add_special_tokens=add_special_tokens).ids

    def decode(self, ids: Sequence[int], skip_special_tokens: bool) -> str:
        return self._model.decode(list(ids), skip_special_tokens=skip_special_tokens)

    def decoder(self, skip_special_tokens: bool) -> Callable[[list[int]], str]:
        return functools.partial(self._model.decode, skip_special_tokens=skip_special_tokens)

    def byte_pieces(self, skip_special_tokens: bool) -> list[bytes] | None:
        return self._byte_pieces[skip_special_tokens]

    @functools.cached_property
    def _byte_pieces(self) -> dict[bool, list[bytes] | None]:
        """byte_pieces for both settings, from one pass over the vocabulary. Byte-level BPE's decoder is exactly
        the join; added tokens decode to their text, taken from a decode of each alone, which must be whole
        characters (else the join might not match what they decode to beside others)."""
        if self._decoder_kinds != {"ByteLevel"}:
            return {True: None, False: None}
        vocabulary = [b""] * self.vocab_size
        for piece, i in self._model.get_vocab(with_added_tokens=False).items():
            spelled = byte_level_piece(piece)
            if spelled is None:  # not a byte-level piece: leave it to decode
                return {True: None, False: None}
            vocabulary[i] = spelled
        tables: dict[bool, list[bytes] | None] = {True: None, False: None}
        for skip in tables:
            added = {
                i: self._model.decode([i], skip_special_tokens=skip) for i in self._model.get_added_tokens_decoder()
            }
            if not any("\ufffd" in text for text in added.values()):
                tables[skip] = list(vocabulary)
                for i, text in added.items():
                    tables[skip][i] = text.encode("utf-8")
        return tables

    @functools.cached_property
    def _decoder_kinds(self) -> set[str]:
        """The types of the tokenizer's decoder steps (one, or each of a Sequence's), which say how its pieces
        spell bytes."""
        decoder = json.loads(self._model.decoder.__getstate__()) if self._model.decoder is not None else {}
        return {d.get("type") for d in decoder.get("decoders", [decoder])}

    def id_to_token(self, token_id: int) -> str | None:
        return self._model.id_to_token(token_id)

    def token_to_id(self, token: str) -> int | None:
        return self._model.token_to_id(token)

    def token_bytes(self) -> list[bytes]:
        piece_bytes = byte_level_bytes if "ByteLevel" in self._decoder_kinds else metaspace_bytes
        added = self._model.get_added_tokens_decoder()
        out = []
        for i in range(self.vocab_size):
            if i in added:  # added tokens are stored as their text, not as pieces
                content = added[i].content
                out.append(special_bytes(content) if added[i].special else content.encode("utf-8"))
            else:
                piece = self._model.id_to_token(i)
                out.append(b"" if piece is None else piece_bytes(piece))
        return out

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


class SentencePieceBackend:
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
    def load(cls, path: Path, added_tokens: dict[int, AddedToken]) -> "SentencePieceBackend":
        proto = sp_model.ModelProto()
        try:
            proto.ParseFromString(path.read_bytes())
        except DecodeError as error:
            raise ModelLoadError(f"Could not load SentencePiece model {path}: {error}") from error
        return cls(proto, added_tokens)

    def trained_special_tokens(self) -> dict[str, str | None]:
        """The special pieces the model was trained with, by name (bos, eos, unk, pad); ids of -1 mean none."""
        processor = self._processor
        ids = {
            "bos": processor.bos_id(),
            "eos": processor.eos_id(),
            "unk": processor.unk_id(),
            "pad": processor.pad_id(),
        }
        return {name: processor.id_to_piece(i) if i >= 0 else None for name, i in ids.items()}

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

    def decoder(self, skip_special_tokens: bool) -> Callable[[list[int]], str]:
        return functools.partial(self.decode, skip_special_tokens=skip_special_tokens)

    def byte_pieces(self, skip_special_tokens: bool) -> None:
        return None  # a run of pieces drops its leading space, and ByteFallback replaces bad bytes one by one

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

    def token_bytes(self) -> list[bytes]:
        kind = sp_model.ModelProto.SentencePiece
        out = []
        for i in range(self.vocab_size):
            if i in self._added_tokens:
                token = self._added_tokens[i]
                out.append(special_bytes(token.content) if token.special else token.content.encode("utf-8"))
            elif i >= len(self._proto.pieces):
                out.append(b"")
            elif (piece := self._proto.pieces[i]).type in (kind.CONTROL, kind.UNKNOWN):
                out.append(special_bytes(piece.piece))
            elif piece.type == kind.USER_DEFINED:  # matched whole in text: its text as written
                out.append(piece.piece.encode("utf-8"))
            else:
                out.append(metaspace_bytes(piece.piece))
        return out

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
