"""Sequence slots: a running request's row in the engine's per-sequence device state (the penalty history the
sampler keeps in arrays of max_num_seqs rows, indexed by slot).

Contract: SequenceSlots is the only writer of Request.slot. A request holds a slot exactly while it is
RUNNING: assigned at admission, given back at preemption or finish, and -1 otherwise.
"""

from __future__ import annotations

from jserve.engine.request import Request


class SequenceSlots:
    def __init__(self, num_slots: int):
        self.num_slots = num_slots
        self.free = list(range(num_slots - 1, -1, -1))  # a stack: slot 0 first, then the latest given back

    @property
    def num_free(self) -> int:
        return len(self.free)

    def assign(self, request: Request) -> None:
        request.slot = self.free.pop()

    def release(self, request: Request) -> None:
        self.free.append(request.slot)
        request.slot = -1

    def check_idle(self) -> None:
        """With nothing running, every slot is free, once."""
        assert sorted(self.free) == list(range(self.num_slots)), "a sequence slot leaked"
