"""Sampling a step's grammar rows after the step was launched (see step.sample_deferred), so that a request
with structured outputs does not stop the host from preparing the next step while the device runs this one.

The step keeps those rows' logits on the device; once the host has fetched the step before and advanced each
grammar past its token, this fills the rows' token bitmasks and samples them, in a small compiled call of D
rows (the step's rows gathered; D the smallest of a few sizes that fits). The calls are compiled in the
background the first time a request brings a grammar, so start-up pays nothing for them; until they are
ready, grammar rows are sampled inside the step, which then waits for its predecessor (as before).
"""

from __future__ import annotations

import dataclasses
import logging
from concurrent.futures import Future, ThreadPoolExecutor

import jax
import numpy as np

from jserve.engine.sampler import BIAS_WIDTH, PADDING, SamplingBatch, full_bitmask
from jserve.engine.step import Sampled, jit_sample_deferred
from jserve.structured import BitmaskFiller, GrammarMatcher

log = logging.getLogger("jserve")


class DeferredSampler:
    def __init__(self, sizes: list[int], vocab_size: int, sharding, filler: BitmaskFiller):
        """`sizes`: the row counts to compile (ascending); `sharding`: the inputs' and outputs' (None: one device)."""
        self.sizes, self.vocab_size, self.sharding, self.filler = sizes, vocab_size, sharding, filler
        self.fn = jit_sample_deferred(sharding)
        self._compiled: dict[int, Future] = {}
        self._compiler: ThreadPoolExecutor | None = None

    def start(self, sampled: Sampled, penalty_state) -> None:
        """Compile the calls in the background (once), for a carry and penalty state shaped like these."""
        if self._compiler is not None:
            return
        self._compiler = ThreadPoolExecutor(1, thread_name_prefix="jserve-deferred-compile")
        abstract = jax.tree.map(lambda a: jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=a.sharding),
                                (sampled, penalty_state))  # fmt: skip
        for size in self.sizes:
            self._compiled[size] = self._compiler.submit(self._compile, size, *abstract)
        self._compiler.shutdown(wait=False)

    def _compile(self, size: int, sampled, penalty_state) -> jax.stages.Compiled:
        inputs = (self._batch(None, np.zeros(0, np.int32), size), np.full(size, -1, np.int32))
        if self.sharding is not None:
            inputs = jax.tree.map(lambda a: jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=self.sharding), inputs)
        compiled = self.fn.lower(sampled, penalty_state, *inputs).compile()
        log.info("Compiled the deferred sampling of %d grammar rows", size)
        return compiled

    @property
    def ready(self) -> bool:
        """Every call is compiled (and none failed)."""
        done = bool(self._compiled) and all(f.done() for f in self._compiled.values())
        return done and not any(f.exception() for f in self._compiled.values())

    def run(
        self, sampled: Sampled, penalty_state, sampling: SamplingBatch, rows: np.ndarray, grammars: list
    ) -> tuple[jax.Array, Sampled]:
        """Sample the step's rows `rows` (with `sampling`, the step's host batch) under their grammars' masks
        (None: a row whose request ended meanwhile, sampled unconstrained and ignored)."""
        size = next(s for s in self.sizes if s >= len(rows))
        batch = self._batch(sampling, rows, size)
        mask = full_bitmask(size, self.vocab_size)
        constrained = [(g, d) for d, g in enumerate(grammars) if isinstance(g, GrammarMatcher)]
        if constrained:
            self.filler.fill(constrained, mask)
        constrained_rows = np.zeros(size, bool)
        constrained_rows[[d for _, d in constrained]] = True
        batch = dataclasses.replace(batch, token_bitmask=mask, constrained=constrained_rows)
        padded = np.full(size, -1, np.int32)
        padded[: len(rows)] = rows
        inputs = (batch, padded) if self.sharding is None else jax.device_put((batch, padded), self.sharding)
        return self._compiled[size].result()(sampled, penalty_state, *inputs)

    def _batch(self, sampling: SamplingBatch | None, rows: np.ndarray, size: int) -> SamplingBatch:
        """`sampling`'s rows `rows`, padded to `size` rows (all padding without `sampling`)."""
        columns = {}
        for field in dataclasses.fields(SamplingBatch):
            name = field.name
            if name == "token_bitmask":
                columns[name] = full_bitmask(size, self.vocab_size)
                continue
            template = self._template(name, size)
            if sampling is not None:
                source = getattr(sampling, name)
                if isinstance(source, np.ndarray):  # (device-resident columns hold padding values only)
                    template[: len(rows)] = source[rows]
            columns[name] = template
        return SamplingBatch(**columns)

    @staticmethod
    def _template(name: str, size: int) -> np.ndarray:
        dtypes = {"top_k": np.int32, "seeds": np.uint32, "steps": np.int32, "slots": np.int32, "bias_ids": np.int32,
                  "wants_top_logprobs": bool, "constrained": bool}  # fmt: skip
        shape = (size, BIAS_WIDTH) if name.startswith("bias_") else (size,)
        return np.full(shape, PADDING[name], dtypes.get(name, np.float32))
