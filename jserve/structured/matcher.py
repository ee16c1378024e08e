"""One request's position in its grammar, and the token bitmasks of a step's constrained rows.

A bitmask row holds one bit per vocabulary id (bit i of word i // 32), set where the grammar allows the
token next; the sampler on device turns the cleared bits into -inf logits.
"""

from __future__ import annotations

import os

import llguidance as llg
import numpy as np
from llguidance.numpy import fill_next_token_bitmask_par, fill_next_token_bitmask_par_with_draft_tokens

MASK_THREADS = 8  # at most; never more than the CPU cores


class GrammarViolation(ValueError):
    """A sampled token the grammar does not allow (only possible if the mask was not applied)."""


class GrammarMatcher:
    def __init__(self, matcher: llg.LLMatcher):
        self._matcher = matcher

    def accept(self, token_id: int) -> None:
        """Advance past a sampled token."""
        if not self._matcher.consume_token(token_id):
            raise GrammarViolation(f"token {token_id} is not allowed by the grammar: {self._matcher.get_error()}")

    def valid_prefix(self, token_ids: np.ndarray) -> int:
        """How many of the tokens, in order, the grammar would accept from here (nothing is consumed)."""
        return self._matcher.validate_tokens([int(t) for t in token_ids])

    @property
    def terminated(self) -> bool:
        """The grammar is complete and allows nothing more: the request ends here."""
        return self._matcher.is_stopped()

    @property
    def llguidance_matcher(self) -> llg.LLMatcher:
        return self._matcher


def bitmask_words(vocab_size: int) -> int:
    return (vocab_size + 31) // 32


class BitmaskFiller:
    """Fills the rows of constrained sequences in a step's bitmask, in parallel across rows."""

    def __init__(self):
        self._executor: llg.LLExecutor | None = None

    def fill(self, rows: list[tuple[GrammarMatcher, int]], bitmask: np.ndarray) -> None:
        fill_next_token_bitmask_par(self.executor, [(m.llguidance_matcher, row) for m, row in rows], bitmask)

    def fill_with_drafts(self, rows: list[tuple[GrammarMatcher, int, np.ndarray]], bitmask: np.ndarray) -> None:
        """For each (matcher, row, drafts): rows row .. row + len(drafts) get the masks after each prefix of
        the drafts (none, the first, ..., all), which the grammar must allow; the matcher is left as it was."""
        entries = [(m.llguidance_matcher, row, [int(t) for t in drafts]) for m, row, drafts in rows]
        fill_next_token_bitmask_par_with_draft_tokens(self.executor, entries, bitmask)

    @property
    def executor(self) -> llg.LLExecutor:
        if self._executor is None:
            self._executor = llg.LLExecutor(min(MASK_THREADS, os.cpu_count() or 1))
        return self._executor
