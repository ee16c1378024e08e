"""The compiled step: one executable per bucket, and where the host decides a step's optional stages
(stages.py: GPUs) one per combination of stages in use.

There warm-up compiles each bucket twice: with no stage (greedy steps) and with every stage behind its device
conditional (right for any batch, but each conditional holds the launching thread until the device reaches
it). A step needing another combination runs on the cheapest executable compiled so far that runs every stage
it needs (a stage that runs leaves the rows that did not ask for it as they were), while its own compiles in
the background: no step waits for a compilation, and later steps with that combination run on their own.
"""

from __future__ import annotations

import logging
import queue
import threading
import time
from collections.abc import Callable
from concurrent.futures import Future
from dataclasses import astuple

import jax

from jserve.engine.stages import DEVICE_DECIDES, NO_STAGES, Gate, StepStages, step_stages

log = logging.getLogger("jserve")

# lowering(bucket, stages, step): a function, called on another thread, that lowers the bucket's step with
# those stages for arguments shaped as now (taken when lowering(...) is called, on the engine's thread)
Lowering = Callable[[int, StepStages, object], Callable[[], jax.stages.Lowered]]


def covers(have: StepStages, need: StepStages) -> bool:
    """Whether an executable compiled with `have` runs every stage `need` runs."""
    return all(h is not Gate.SKIP or n is Gate.SKIP for h, n in zip(astuple(have), astuple(need), strict=True))


def cost(stages: StepStages) -> tuple[bool, int]:
    """Which of two covering executables to prefer: no conditionals, then fewer stages."""
    return stages == DEVICE_DECIDES, sum(gate is not Gate.SKIP for gate in astuple(stages))


class StepExecutables:
    def __init__(self, host_decides: bool, vocab_size: int, lowering: Lowering):
        self.host_decides = host_decides
        self.vocab_size = vocab_size
        self.lowering = lowering
        self.compiled: dict[tuple[int, StepStages], jax.stages.Compiled] = {}
        self._pending: dict[tuple[int, StepStages], Future] = {}
        # A daemon thread: a process that is done does not wait for compilations it no longer needs.
        self._queue: queue.SimpleQueue = queue.SimpleQueue()
        self._worker: threading.Thread | None = None

    def stages(self, step) -> StepStages:
        """The stages a step needs run, as its executable would have them."""
        if not self.host_decides:
            return DEVICE_DECIDES
        return step_stages(step, self.vocab_size)

    def warm_up_stages(self) -> list[StepStages]:
        """What each bucket compiles at warm-up (its all-padding step needs no stage)."""
        return [NO_STAGES, DEVICE_DECIDES] if self.host_decides else [DEVICE_DECIDES]

    def add(self, bucket: int, stages: StepStages, compiled: jax.stages.Compiled) -> None:
        self.compiled[(bucket, stages)] = compiled

    def for_step(self, bucket: int, step) -> jax.stages.Compiled:
        """The executable to run `step` on now."""
        key = (bucket, need := self.stages(step))
        if (compiled := self.compiled.get(key)) is not None:
            return compiled
        if key not in self._pending:
            self._compile_in_background(key, self.lowering(bucket, need, step))
        have = min((s for b, s in list(self.compiled) if b == bucket and covers(s, need)), key=cost)
        return self.compiled[(bucket, have)]

    def finish(self) -> None:
        """Wait for the compilations under way (for tests)."""
        for future in list(self._pending.values()):
            future.result()

    def close(self) -> None:
        self._queue.put(None)

    def _compile_in_background(self, key: tuple[int, StepStages], lower: Callable[[], jax.stages.Lowered]) -> None:
        log.info("Compiling bucket %d with %s in the background", *key)
        self._pending[key] = future = Future()
        self._queue.put((key, lower, future))
        if self._worker is None:
            self._worker = threading.Thread(target=self._work, name="jserve-stages", daemon=True)
            self._worker.start()

    def _work(self) -> None:
        while (item := self._queue.get()) is not None:
            (bucket, stages), lower, future = item
            start = time.perf_counter()
            try:
                self.compiled[(bucket, stages)] = lower().compile()
            except Exception as error:  # (steps with these stages keep running on a covering executable)
                log.exception("Compiling bucket %d with %s failed", bucket, stages)
                future.set_exception(error)
            else:
                log.info("Compiled bucket %d with %s in %.1fs", bucket, stages, time.perf_counter() - start)
                future.set_result(None)
