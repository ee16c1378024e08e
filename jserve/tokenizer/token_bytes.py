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
from functools import cache

SPECIAL_MARKER = b"\xff"
METASPACE = "▁"
_BYTE_PIECE = re.compile(r"<0x([0-9A-Fa-f]{2})>")


@cache
def _byte_level_table() -> dict[str, int]:
    """GPT-2's byte-to-character table, inverted: printable Latin-1 bytes stand for themselves and the
    other 68 bytes (controls, space, a few Latin-1 gaps) take the characters from U+0100 on, in order."""
    printable = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1), *range(ord("®"), ord("ÿ") + 1)]
    table = {chr(b): b for b in printable}
    others = (b for b in range(256) if b not in set(printable))
    table.update({chr(256 + i): b for i, b in enumerate(others)})
    return table


def byte_level_bytes(piece: str) -> bytes:
    table = _byte_level_table()
    try:
        return bytes(table[c] for c in piece)
    except KeyError:  # not a byte-level piece (e.g. an added token written as plain text)
        return piece.encode("utf-8")


def metaspace_bytes(piece: str) -> bytes:
    """A SentencePiece-style piece: "<0xAB>" is the byte 0xAB, "▁" a space, anything else its UTF-8."""
    match = _BYTE_PIECE.fullmatch(piece)
    if match:
        return bytes([int(match.group(1), 16)])
    return piece.replace(METASPACE, " ").encode("utf-8")


def special_bytes(piece: str) -> bytes:
    return SPECIAL_MARKER + piece.encode("utf-8")
