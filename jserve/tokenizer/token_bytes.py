"""The bytes each vocabulary entry stands for, as a grammar engine must see them.

A token's *piece* is how the tokenizer stores it, not the text it decodes to: byte-level BPE writes each
byte as a printable stand-in character (GPT-2's table), SentencePiece-style vocabularies write spaces as
"▁" and byte-fallback tokens as "<0xAB>". Grammar-constrained decoding needs the raw bytes of every
token, including the tokens that hold half a UTF-8 character, so they are mapped back here.

Special (control) tokens are marked with a leading 0xFF byte, which no UTF-8 text contains: llguidance's
convention for "this token is not text; only a grammar that names it may produce it".
"""

from __future__ import annotations

import re

SPECIAL_MARKER = b"\xff"
METASPACE = "▁"
_BYTE_PIECE = re.compile(r"<0x([0-9A-Fa-f]{2})>")


def _byte_spelling() -> dict[int, str]:
    """GPT-2's map from each byte to a printable character standing for it: printable Latin-1 bytes stand
    for themselves, the other 68 (controls, space, a few Latin-1 gaps) take the characters from U+0100 on."""
    printable = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1), *range(ord("®"), ord("ÿ") + 1)]
    spelling = {byte: chr(byte) for byte in printable}
    shifted = (byte for byte in range(256) if byte not in spelling)
    for offset, byte in enumerate(shifted):
        spelling[byte] = chr(256 + offset)
    return spelling


BYTE_SPELLING = _byte_spelling()  # byte -> its character in byte-level BPE pieces
_BYTE_OF = {char: byte for byte, char in BYTE_SPELLING.items()}
BYTE_LEVEL_CHARS = frozenset(_BYTE_OF)  # the characters byte-level pieces are spelled with
_TO_LATIN1 = str.maketrans({char: chr(byte) for char, byte in _BYTE_OF.items()})


def byte_level_piece(piece: str) -> bytes | None:
    """A byte-level piece's bytes; None if it is not spelled with byte-level characters."""
    if not BYTE_LEVEL_CHARS.issuperset(piece):
        return None
    return piece.translate(_TO_LATIN1).encode("latin-1")  # each character one byte


def byte_level_bytes(piece: str) -> bytes:
    spelled = byte_level_piece(piece)
    return spelled if spelled is not None else piece.encode("utf-8")  # e.g. an added token written as text


def metaspace_bytes(piece: str) -> bytes:
    """A SentencePiece-style piece: "<0xAB>" is the byte 0xAB, "▁" a space, anything else its UTF-8."""
    match = _BYTE_PIECE.fullmatch(piece)
    if match:
        return bytes([int(match.group(1), 16)])
    return piece.replace(METASPACE, " ").encode("utf-8")


def special_bytes(piece: str) -> bytes:
    return SPECIAL_MARKER + piece.encode("utf-8")
