"""Multi-host tensor parallelism: one JAX process per host, every device of every host in one mesh.

JAX is multi-controller: each process must launch the same computations, in the same order, on the same
shapes. jserve makes process 0 the leader, which runs the scheduler (and the HTTP server), and every other
process a follower that mirrors it: each step the leader broadcasts the bucket it chose and the step's host
arrays, and then all processes launch that bucket's executable together. Start-up (loading, KV allocation,
warm-up) is the same deterministic sequence on every process, so it needs no messages.
"""

from __future__ import annotations

import argparse
import logging
from collections.abc import Callable
from dataclasses import dataclass

import jax
import numpy as np
from jax.experimental import multihost_utils

log = logging.getLogger("jserve")

STOP = 0  # the bucket a leader broadcasts to tell followers it has closed


@dataclass(frozen=True)
class DistributedArgs:
    """How this process joins the others. With none of the three set, `jax.distributed.initialize` finds
    them itself on a TPU pod slice, under SLURM, or under Open MPI."""

    distributed: bool = False
    coordinator_address: str | None = None  # host:port of process 0
    num_processes: int | None = None
    process_id: int | None = None

    @property
    def enabled(self) -> bool:
        return self.distributed or any(
            v is not None for v in (self.coordinator_address, self.num_processes, self.process_id)
        )

    def initialize(self) -> None:
        if self.enabled:
            initialize_distributed(self.coordinator_address, self.num_processes, self.process_id)

    @staticmethod
    def add_cli_args(parser: argparse.ArgumentParser) -> None:
        group = parser.add_argument_group("multi-host", "one process per host; process 0 serves, the rest follow")
        group.add_argument(
            "--distributed",
            action="store_true",
            help="join a multi-host run, detected from the TPU pod / SLURM / Open MPI environment",
        )
        group.add_argument("--coordinator-address", default=None, help="host:port of process 0 (implies --distributed)")
        group.add_argument("--num-processes", type=int, default=None, help="processes in the run, one per host")
        group.add_argument("--process-id", type=int, default=None, help="this process's rank; 0 leads")

    @classmethod
    def from_cli_args(cls, args: argparse.Namespace) -> DistributedArgs:
        return cls(args.distributed, args.coordinator_address, args.num_processes, args.process_id)


def initialize_distributed(
    coordinator_address: str | None = None, num_processes: int | None = None, process_id: int | None = None
) -> None:
    """Join the other processes (before anything touches a device). On CPU, cross-process collectives go
    over gloo, so the same code runs on a laptop's processes as on a GPU cluster."""
    jax.config.update("jax_cpu_collectives_implementation", "gloo")
    jax.distributed.initialize(coordinator_address, num_processes, process_id)
    log.info("Process %d of %d: %d local of %d devices (%s)", jax.process_index(), jax.process_count(),
             jax.local_device_count(), jax.device_count(), jax.devices()[0].platform)  # fmt: skip


def is_multi_process() -> bool:
    return jax.process_count() > 1


def is_leader() -> bool:
    return jax.process_index() == 0


def agree_on_min(value: int) -> int:
    """The smallest of every process's value, e.g. the KV pages each host's free memory allows: every
    process must build identical shapes."""
    if not is_multi_process():
        return value
    return int(np.min(multihost_utils.process_allgather(np.int64(value))))


class StepBroadcast:
    """Leader → followers, once per step: the bucket (STOP when the leader closes), then the step's arrays.
    A follower needs the arrays' shapes before it can receive them; `template(bucket)` gives them."""

    def __init__(self, template: Callable[[int], object]):
        self.template = template

    def send(self, bucket: int, step) -> None:
        multihost_utils.broadcast_one_to_all(np.int32(bucket))
        multihost_utils.broadcast_one_to_all(step)

    def stop(self) -> None:
        multihost_utils.broadcast_one_to_all(np.int32(STOP))

    def receive(self) -> tuple[int, object] | None:
        """The leader's next step, or None once it has closed."""
        bucket = int(multihost_utils.broadcast_one_to_all(np.int32(STOP)))
        if bucket == STOP:
            return None
        return bucket, multihost_utils.broadcast_one_to_all(self.template(bucket))
