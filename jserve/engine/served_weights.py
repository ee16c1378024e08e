"""The weights an engine serves and the device memory it holds for them: new weights swapped in between
requests (LLM.update_weights), and sleep / wake (LLM.sleep) for a trainer that needs the device meanwhile.

A swap waits until no request is in flight (running, or preempted and waiting to resume), so no request
ever sees two sets of weights; meanwhile the scheduler admits no request that has not started. Cached
prefixes go with the old weights. Nothing compiles: new weights have the shapes, dtypes and shardings the
steps were compiled for (ModelRunner.set_params checks).
"""

from __future__ import annotations

import logging

import jax
from flax import nnx

from jserve.engine.runner import ModelRunner
from jserve.engine.scheduler import Scheduler
from jserve.errors import EngineAsleepError, WeightUpdateError
from jserve.loader import LoadedModel
from jserve.parallel.distributed import is_multi_process

log = logging.getLogger("jserve")


class ServedWeights:
    def __init__(self, model: LoadedModel, runner: ModelRunner, scheduler: Scheduler):
        self.model, self.runner, self.scheduler = model, runner, scheduler
        self.version = 0  # +1 with each swap: every output says which weights made it
        self.sleeping = False  # the KV cache is freed until wake_up()
        self.dropped = False  # sleep(level=2): no weights until new ones come
        self.pending: nnx.State | None = None  # new weights waiting for the requests in flight

    def check_serving(self) -> None:
        """Raise if a request cannot be served now (asleep, or without weights)."""
        if self.sleeping:
            raise EngineAsleepError("the engine is asleep: call wake_up() before generating")
        if self.pending is None:
            self.check_held()

    def check_held(self) -> None:
        """Raise if sleep(level=2) let the weights go and none came since."""
        if self.dropped:
            raise EngineAsleepError("the engine's weights were dropped by sleep(level=2): call update_weights() first")

    def update(self, params: nnx.State, step_in_flight: bool) -> bool:
        """Serve `params` (the model's params with new values: loader.weight_update) once nothing is in
        flight; returns whether they serve already."""
        if is_multi_process():
            raise WeightUpdateError("new weights reach this process's engine only: across hosts, reload instead")
        self.pending = params
        self.scheduler.hold_new = True
        if self.swap(step_in_flight):
            return True
        log.info("New weights wait for %d requests in flight to finish", self.scheduler.num_in_flight)
        return False

    def swap(self, step_in_flight: bool) -> bool:
        """The pending weights in, if nothing in flight needs the old ones."""
        if step_in_flight or self.scheduler.num_in_flight:
            return False
        self.runner.set_params(self.pending)
        self.model.params, self.pending = self.pending, None
        self.dropped = self.scheduler.hold_new = False
        dropped_pages = self.scheduler.kv.drop_cache()
        self.version += 1
        log.info("Weights version %d serving; %d cached prefix pages dropped", self.version, dropped_pages)
        return True

    def sleep(self, level: int) -> None:
        """Level 1: free the KV cache and each slot's sampling state; level 2: also let go of the weights.
        Only between requests (the engine checks)."""
        if level not in (1, 2):
            raise ValueError(f"sleep level must be 1 or 2; got {level}")
        if self.pending is not None:
            self.swap(step_in_flight=False)  # they waited for requests that have finished since
        if not self.sleeping:
            self.scheduler.kv.drop_cache()  # the cached K/V goes with the cache
            freed = self.runner.release_memory()
            self.sleeping = True
            log.info("Asleep: %.2f GiB of KV cache and sampling state freed", freed / 2**30)
        if level == 2 and not self.dropped:
            # Only the engine's references go (kept as shapes and shardings for the next update): arrays a
            # trainer handed over and still holds stay its own.
            abstract = jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=x.sharding),
                                    self.model.params)  # fmt: skip
            self.runner.params = jax.tree_util.tree_leaves(abstract)
            self.model.params, self.dropped = abstract, True
            log.info("Weights dropped: update_weights() brings new ones")

    def wake_up(self) -> None:
        """Allocate what sleep() freed (a no-op when awake); nothing compiles."""
        if self.sleeping:
            self.runner.allocate_memory()
            self.sleeping = False
            log.info("Awake")
