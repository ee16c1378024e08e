"""Prompt lookup: propose the tokens that followed the latest earlier occurrence of the sequence's last n
tokens (the longest n in [min, max] that occurred): text that quotes its prompt, or repeats itself, repeats
what came before."""

from __future__ import annotations

import numpy as np


def propose_ngram(tokens: np.ndarray, min_n: int, max_n: int, num_tokens: int) -> np.ndarray:
    """Up to `num_tokens` drafts to follow `tokens` (empty when no n-gram of its tail occurred before).

    One vectorised pass: where each earlier position's token equals the last token, then how far the match
    runs back (compared as shifted views, up to max_n)."""
    length = len(tokens)
    if num_tokens <= 0 or length <= min_n:
        return tokens[:0]
    # Candidates end at i < length - 1 (an occurrence of the tail that is followed by something).
    ends = np.flatnonzero(tokens[: length - 1] == tokens[-1])
    if len(ends) == 0:
        return tokens[:0]
    run = np.ones(len(ends), np.int64)  # matched tail length for each candidate, so far
    alive = np.ones(len(ends), bool)
    for back in range(1, min(max_n, length - 1)):
        at = ends - back
        alive &= at >= 0
        alive[alive] = tokens[at[alive]] == tokens[length - 1 - back]
        if not alive.any():
            break
        run += alive
    best = run.max()
    if best < min_n:
        return tokens[:0]
    # The latest occurrence of the longest match that is followed by num_tokens tokens (recent text predicts
    # best), or else the earliest (in a loop the latest is followed by too little).
    starts = ends[run == best] + 1
    full = starts[starts + num_tokens <= length]
    start = full[-1] if len(full) else starts[0]
    return tokens[start : start + num_tokens]
