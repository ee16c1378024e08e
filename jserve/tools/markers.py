"""Finding a marker such as "<tool_call>" in text that is still growing."""

from __future__ import annotations


def partial_start(text: str, marker: str, start: int = 0) -> int:
    """Where the longest suffix of text[start:] that is a proper prefix of marker begins, or len(text): from
    there on the text could still turn into the marker."""
    for i in range(max(start, len(text) - len(marker) + 1), len(text)):
        if marker.startswith(text[i:]):
            return i
    return len(text)


def find_marker(text: str, marker: str, start: int = 0, final: bool = False) -> tuple[int, bool]:
    """(position, True) for the first marker in text[start:]; no continuation of the text can add an earlier
    one, as that would have to begin before it and end after it. Otherwise (end, False), where no marker
    begins in text[start:end] whatever follows: end is len(text) for the final text, else where the text
    ends with the beginning of a marker."""
    pos = text.find(marker, start)
    if pos != -1:
        return pos, True
    return (len(text) if final else partial_start(text, marker, start)), False
