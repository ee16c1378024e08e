"""Rebuilding a checkpoint's tokenizer from GGUF metadata.

A GGUF carries no tokenizer file, only llama.cpp's `tokenizer.ggml.*` keys:
the vocabulary, merges or scores, token types and special ids. From these we
rebuild either a byte-level BPE (`tokenizers`) or a SentencePiece model.
"""

import logging
from dataclasses import dataclass
from typing import Any

import gguf
from sentencepiece import sentencepiece_model_pb2 as sp_model
from tokenizers import AddedToken, Regex, decoders, models, pre_tokenizers
from tokenizers import Tokenizer as HFTokenizer

from jserve.errors import ModelLoadError
from jserve.tokenizer.token_bytes import BYTE_SPELLING

logger = logging.getLogger(__name__)

SUPPORTED_MODELS = ("gpt2", "llama")

# llama.cpp token types; SentencePiece numbers its piece types the same way.
_CONTROL = 3
_USER_DEFINED = 4
_BYTE = 6

# Split patterns of the tokenizers whose merges were learned on these splits.
_LLAMA3_SPLIT = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}"
    r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)
_QWEN2_SPLIT = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}"
    r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)


@dataclass(frozen=True)
class GGUFTokenizer:
    """What a GGUF says about its tokenizer; `model` is ready to wrap."""

    model: HFTokenizer | sp_model.ModelProto
    tokens: list[str]
    bos_token_id: int | None
    eos_token_id: int | None
    unk_token_id: int | None
    pad_token_id: int | None
    add_bos_token: bool
    add_eos_token: bool
    chat_template: str | None


def read_gguf_tokenizer(reader: gguf.GGUFReader) -> GGUFTokenizer:
    model_name = _field(reader, "tokenizer.ggml.model")
    if model_name not in SUPPORTED_MODELS:
        raise ModelLoadError(
            f"GGUF tokenizer model {model_name!r} is not supported; supported models: {', '.join(SUPPORTED_MODELS)}"
        )
    tokens = _required_field(reader, "tokenizer.ggml.tokens")
    token_types = _field(reader, "tokenizer.ggml.token_type") or [1] * len(tokens)
    bos_id = _field(reader, "tokenizer.ggml.bos_token_id")
    eos_id = _field(reader, "tokenizer.ggml.eos_token_id")
    # llama.cpp adds BOS for SentencePiece vocabularies that do not say otherwise.
    add_bos = bool(_field(reader, "tokenizer.ggml.add_bos_token", model_name == "llama"))
    add_eos = bool(_field(reader, "tokenizer.ggml.add_eos_token", False))
    unk_id = _field(reader, "tokenizer.ggml.unknown_token_id")
    pad_id = _field(reader, "tokenizer.ggml.padding_token_id")

    if model_name == "gpt2":
        model = _byte_level_bpe(
            tokens,
            token_types,
            _required_field(reader, "tokenizer.ggml.merges"),
            _field(reader, "tokenizer.ggml.pre", "default"),
        )
    else:
        model = _sentencepiece_proto(
            tokens,
            _required_field(reader, "tokenizer.ggml.scores"),
            token_types,
            add_space_prefix=bool(_field(reader, "tokenizer.ggml.add_space_prefix", True)),
            unk_id=unk_id,
        )
    return GGUFTokenizer(
        model=model,
        tokens=tokens,
        bos_token_id=bos_id,
        eos_token_id=eos_id,
        unk_token_id=unk_id,
        pad_token_id=pad_id,
        add_bos_token=add_bos,
        add_eos_token=add_eos,
        chat_template=_field(reader, "tokenizer.chat_template"),
    )


def _field(reader: gguf.GGUFReader, key: str, default: Any = None) -> Any:
    field = reader.fields.get(key)
    return default if field is None else field.contents()


def _required_field(reader: gguf.GGUFReader, key: str) -> Any:
    if key not in reader.fields:
        raise ModelLoadError(f"GGUF file has no {key}, so its tokenizer cannot be rebuilt")
    return reader.fields[key].contents()


def _byte_level_bpe(tokens: list[str], token_types: list[int], merges: list[str], pre: str) -> HFTokenizer:
    # Control and user-defined tokens keep their raw text: they are matched
    # whole in the input (never built by merges) and decode to themselves.
    raw = {i for i, kind in enumerate(token_types) if kind in (_CONTROL, _USER_DEFINED)}
    vocab: dict[str, int] = {}
    for token_id, token in enumerate(tokens):
        vocab.setdefault(token if token_id in raw else _respell(token), token_id)
    pairs = [tuple(_respell(part) for part in merge.split(" ", 1)) for merge in merges]

    # Llama 3 looks a whole word up in the vocabulary before merging, as llama.cpp does.
    model = HFTokenizer(models.BPE(vocab=vocab, merges=pairs, ignore_merges=pre in ("llama-bpe", "llama3")))
    model.pre_tokenizer = _byte_level_pre_tokenizer(pre)
    model.decoder = decoders.ByteLevel()
    model.add_special_tokens(
        [AddedToken(tokens[i], special=True, normalized=False) for i in sorted(raw) if token_types[i] == _CONTROL]
    )
    model.add_tokens(
        [AddedToken(tokens[i], special=False, normalized=False) for i in sorted(raw) if token_types[i] == _USER_DEFINED]
    )
    return model


_BYTE_LETTERS = frozenset(BYTE_SPELLING.values())


def _respell(token: str) -> str:
    # Some converters store a token as plain text; BPE needs it in the byte alphabet.
    if _BYTE_LETTERS.issuperset(token):
        return token
    return "".join(BYTE_SPELLING[byte] for byte in token.encode("utf-8"))


def _byte_level_pre_tokenizer(pre: str) -> pre_tokenizers.PreTokenizer:
    gpt2 = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    if pre == "smollm":
        # SmolLM's merges were learned on text whose digits were split one by one.
        return pre_tokenizers.Sequence([pre_tokenizers.Digits(individual_digits=True), gpt2])
    split = {"llama-bpe": _LLAMA3_SPLIT, "llama3": _LLAMA3_SPLIT, "qwen2": _QWEN2_SPLIT}.get(pre)
    if split is not None:
        return pre_tokenizers.Sequence(
            [
                pre_tokenizers.Split(Regex(split), behavior="isolated"),
                pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
            ]
        )
    if pre not in ("default", "gpt2", "gpt-2"):
        logger.warning("Unknown GGUF pre-tokenizer %r; splitting text like GPT-2 instead", pre)
    return gpt2


def _sentencepiece_proto(
    tokens: list[str], scores: list[float], token_types: list[int], *, add_space_prefix: bool, unk_id: int | None
) -> sp_model.ModelProto:
    proto = sp_model.ModelProto()
    for token, score, kind in zip(tokens, scores, token_types, strict=True):
        proto.pieces.add(piece=token, score=score, type=kind)
    proto.trainer_spec.model_type = sp_model.TrainerSpec.BPE
    proto.trainer_spec.byte_fallback = _BYTE in token_types
    if unk_id is not None:
        proto.trainer_spec.unk_id = unk_id
        proto.trainer_spec.unk_piece = tokens[unk_id]
    # GGUF text is not normalised beyond SentencePiece's whitespace escaping.
    proto.normalizer_spec.name = "identity"
    proto.normalizer_spec.add_dummy_prefix = add_space_prefix
    proto.normalizer_spec.escape_whitespaces = True
    proto.normalizer_spec.remove_extra_whitespaces = False
    return proto
