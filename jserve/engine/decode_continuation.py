"""The next step of a steady decode, made from the last one: most steps of a busy engine decode the same
requests, in the same rows, one token each, every token still on the device. Their inputs differ from the
last step's only in positions, context lengths, K/V slots and sampling step counters (each one more), and in
the page-table rows of requests that crossed into a new page. So such a step copies the last step's packed
host arrays (step_packing.py) and advances those few in place, instead of building every input from the
requests: a handful of numpy calls, whatever the batch.

A step qualifies when the last one was launched from the same request list and bucket, and both are plain
decodes: one token per row, taken from the previous step's samples in its own row, no grammar mask, logit
bias, prompt scoring, drafts or proposals (penalty rows then stay as they were: every token is an output).
Anything else goes through ModelRunner.prepare, which also checks this path under debug checks (the tests).
"""

from __future__ import annotations

from dataclasses import dataclass

import jax
import numpy as np

from jserve.engine.input_batch import HAS_BIAS, HAS_GRAMMAR, SCORES_PROMPT, InputBatch
from jserve.engine.request import Request
from jserve.engine.scheduler import ScheduledSequence
from jserve.engine.step import StepInput
from jserve.engine.step_packing import PackedStep, StepPacking

# What a continued step advances, by leaf of a StepInput: int32 vectors, packed, and the page tables.
ADVANCED = (".model.attention.positions", ".model.attention.slot_mapping", ".model.attention.context_lens",
            ".sampling.steps")  # fmt: skip
PAGE_TABLES = ".model.attention.page_tables"


def decodes_one(s: ScheduledSequence) -> bool:
    """The sequence computes one token, its latest, and samples the next: no drafts, no proposals, not its first
    chunk since admission."""
    return s.num_tokens == 1 and s.samples and not s.proposes and not s.first


@dataclass(frozen=True)
class Places:
    """Where one bucket's advanced inputs are: their leaf indices, their offsets in the packed ints, and the
    page tables' leaf and index among the packed step's other arrays."""

    leaves: tuple[int, ...]
    offsets: tuple[int, ...]
    page_tables: tuple[int, int]

    @staticmethod
    def of(packing: StepPacking, step: StepInput) -> Places:
        paths = [jax.tree_util.keystr(path) for path, _ in jax.tree_util.tree_flatten_with_path(step)[0]]
        leaves = tuple(paths.index(name) for name in ADVANCED)
        tables = paths.index(PAGE_TABLES)
        return Places(leaves, tuple(packing.places[i][1] for i in leaves), (tables, packing.places[tables][1]))


@dataclass(frozen=True)
class DecodeContinuation:
    """A launched plain decode step, as the base of the next one. Its arrays are read-only: the device may
    still read them."""

    requests: list[Request]  # its sequences' requests, by row
    bucket: int
    leaves: list  # its StepInput's leaves
    packed: PackedStep
    treedef: jax.tree_util.PyTreeDef
    places: Places

    @staticmethod
    def of(sequences: list[ScheduledSequence], bucket: int, step: StepInput, packed: PackedStep, batch: InputBatch,
           places: Places) -> DecodeContinuation | None:  # fmt: skip
        """The continuation of a step just built from `sequences`, or None if it is not a plain decode of every
        row's pending token."""
        n = len(sequences)
        if not n or batch.facts[step.sampling.slots[:n]][:, (HAS_BIAS, HAS_GRAMMAR, SCORES_PROMPT)].any():
            return None  # (a bias may change with min_tokens; grammar rows get masks; scoring needs targets)
        if not all(map(decodes_one, sequences)):
            return None
        if not np.array_equal(step.pending_rows[:n], np.arange(n)):
            return None  # a row's token is not the previous step's sample in that row
        leaves, treedef = jax.tree_util.tree_flatten(step)
        return DecodeContinuation([s.request for s in sequences], bucket, leaves, packed, treedef, places)

    def next(self, sequences: list[ScheduledSequence], batch: InputBatch):
        """This step's inputs (unpacked and packed) and its continuation, if `sequences` continue the launched
        step (the same requests in the same rows, each decoding); else None."""
        requests, moved = self.requests, []
        if len(sequences) != len(requests):
            return None
        pages = batch.pages
        for i, s in enumerate(sequences):  # (Request compares by identity)
            request = s.request
            if request is not requests[i] or not decodes_one(s):
                return None
            if pages[request.slot] is not request.pages:  # it reached a new page
                moved.append(i)
        n, page_size, places = len(requests), batch.page_size, self.places
        ints = self.packed.ints.copy()
        positions, slots, context_lens, steps = (ints[offset : offset + n] for offset in places.offsets)
        positions += 1
        context_lens += 1
        steps += 1
        table_leaf, table_index = places.page_tables
        page_tables, arrays = self.leaves[table_leaf], self.packed.arrays
        if moved:
            page_tables = page_tables.copy()
            for i in moved:
                request = requests[i]
                batch.set_pages(request.slot, request.pages)
                page_tables[i] = batch.page_table[request.slot]
            arrays = (*arrays[:table_index], page_tables, *arrays[table_index + 1 :])
        slots[:] = page_tables[np.arange(n), positions // page_size] * page_size + positions % page_size
        leaves = list(self.leaves)
        for leaf, offset in zip(places.leaves, places.offsets, strict=True):
            leaves[leaf] = ints[offset : offset + len(leaves[leaf])]
        leaves[table_leaf] = page_tables
        packed = PackedStep(ints, self.packed.floats, arrays)
        continuation = DecodeContinuation(requests, self.bucket, leaves, packed, self.treedef, places)
        return self.treedef.unflatten(leaves), packed, continuation


def check_same_inputs(continued: tuple[StepInput, PackedStep], built: tuple[StepInput, PackedStep]) -> None:
    """Raise if a continued step's inputs, unpacked or packed, differ from those built afresh (debug checks)."""
    built_leaves = jax.tree_util.tree_leaves(built)
    for (path, a), b in zip(jax.tree_util.tree_flatten_with_path(continued)[0], built_leaves, strict=True):
        if a is not b and not np.array_equal(np.asarray(a), np.asarray(b)):
            raise AssertionError(
                f"a continued decode step's {jax.tree_util.keystr(path)} differs from its inputs built afresh"
            )
