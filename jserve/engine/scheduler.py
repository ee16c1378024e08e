"""Each step, spend a token budget over running requests (decodes, unfinished prefills) and new admissions.

Running requests go first, oldest first, each getting its next token (decode) or its next prefill chunk;
waiting requests are then admitted in (priority, arrival) order while budget, sequence slots and KV pages
last. When a running request needs a page and none is free, the least urgent running request (the worst
priority, latest admitted) is preempted by recompute: its pages are freed and it waits again at the head
of its priority class, keeping its output so far.
"""

from __future__ import annotations

import bisect
import heapq
import itertools
import logging
import time
from dataclasses import dataclass

import numpy as np

from jserve.engine.config import EngineConfig
from jserve.engine.page_pool import PagePool
from jserve.engine.request import Request, RequestStatus

log = logging.getLogger("jserve")


@dataclass(frozen=True)
class ScheduledSequence:
    request: Request
    start: int  # first token computed this step (the request's num_computed_tokens)
    num_tokens: int

    @property
    def samples(self) -> bool:
        """The chunk reaches the last known token, so its logits give the request's next token."""
        return self.start + self.num_tokens == self.request.num_tokens


@dataclass(frozen=True)
class SchedulerOutput:
    sequences: list[ScheduledSequence]
    preempted: list[Request]

    @property
    def num_tokens(self) -> int:
        return sum(s.num_tokens for s in self.sequences)


class Scheduler:
    def __init__(self, config: EngineConfig):
        self.config = config
        self.pool = PagePool(config.num_pages)
        self.waiting: list[tuple[int, int, int, Request]] = []  # heap by (priority, arrival, completion index)
        self.running: list[Request] = []  # sorted by (priority, admit order): the last is preempted first
        self.free_slots = list(range(config.max_num_seqs - 1, -1, -1))
        self._admissions = itertools.count()

    @property
    def num_unfinished(self) -> int:
        return len(self.running) + sum(not entry[-1].is_finished for entry in self.waiting)

    def add(self, request: Request) -> None:
        heapq.heappush(self.waiting, (request.priority, request.arrival_index, request.index, request))

    def schedule(self) -> SchedulerOutput:
        budget = self.config.max_num_batched_tokens
        scheduled: list[ScheduledSequence] = []
        preempted: list[Request] = []
        i = 0
        while i < len(self.running) and budget > 0:
            request = self.running[i]
            n = min(request.num_tokens - request.num_computed_tokens, budget)
            while not self._reserve_pages(request, request.num_computed_tokens + n):
                victim = self.running[-1]
                self._preempt(victim)
                preempted.append(victim)
                if victim is request:
                    break
            if request.status is not RequestStatus.RUNNING:
                break
            scheduled.append(ScheduledSequence(request, request.num_computed_tokens, n))
            budget -= n
            i += 1

        # Admit only when nothing had to be preempted: pages are short.
        while not preempted and self.waiting and budget > 0 and self.free_slots:
            request = self.waiting[0][-1]
            if request.is_finished:  # aborted while waiting
                heapq.heappop(self.waiting)
                continue
            n = min(request.num_tokens - request.num_computed_tokens, budget)
            if self._pages_needed(request, request.num_computed_tokens + n) > self.pool.num_free:
                break
            heapq.heappop(self.waiting)
            self._admit(request)
            self._reserve_pages(request, request.num_computed_tokens + n)
            scheduled.append(ScheduledSequence(request, request.num_computed_tokens, n))
            budget -= n
        return SchedulerOutput(self._fit_to_bucket(scheduled), preempted)

    def _fit_to_bucket(self, scheduled: list[ScheduledSequence]) -> list[ScheduledSequence]:
        """Padded tokens cost as much as real ones, so a last prefill chunk that spills just past a token
        bucket is cut back to that bucket's edge when it keeps at least half its tokens; the rest then
        fills the padding of a following (usually decode-only) step."""
        if not scheduled:
            return scheduled
        last = scheduled[-1]
        total = sum(s.num_tokens for s in scheduled)
        edge = max((b for b in self.config.token_buckets if b < total), default=0)
        keep = last.num_tokens - (total - edge)
        if last.request.num_computed_tokens >= last.request.num_prompt_tokens or 2 * keep < last.num_tokens:
            return scheduled  # a decode, or too little would be left
        return [*scheduled[:-1], ScheduledSequence(last.request, last.start, keep)]

    def finish(self, request: Request, reason: str, stop_reason: int | str | None = None) -> None:
        """End a request wherever it is; its pages and slot return to the pools."""
        if request.is_finished:
            return
        if request.status is RequestStatus.RUNNING:
            self._release(request)
            self.running.remove(request)
        request.status = RequestStatus.FINISHED
        request.finish_reason, request.stop_reason = reason, stop_reason
        request.finish_time = time.monotonic()

    def _admit(self, request: Request) -> None:
        request.status = RequestStatus.RUNNING
        request.slot = self.free_slots.pop()
        request.admit_index = next(self._admissions)
        if request.first_scheduled_time is None:
            request.first_scheduled_time = time.monotonic()
        keys = [(r.priority, r.admit_index) for r in self.running]
        self.running.insert(bisect.bisect(keys, (request.priority, request.admit_index)), request)

    def _pages_needed(self, request: Request, num_tokens: int) -> int:
        return -(-num_tokens // self.config.page_size) - len(request.pages)

    def _reserve_pages(self, request: Request, num_tokens: int) -> bool:
        needed = self._pages_needed(request, num_tokens)
        if needed <= 0:
            return True
        if needed > self.pool.num_free:
            return False
        request.pages = np.concatenate([request.pages, self.pool.allocate(needed)])
        return True

    def _preempt(self, request: Request) -> None:
        self._release(request)
        self.running.remove(request)
        request.status = RequestStatus.PREEMPTED
        request.num_computed_tokens = 0
        request.num_preemptions += 1
        heapq.heappush(self.waiting, (request.priority, request.arrival_index, request.index, request))
        log.debug("preempted %s (%d tokens to recompute)", request.request_id, request.num_tokens)

    def _release(self, request: Request) -> None:
        self.pool.release(request.pages)
        request.pages = np.zeros(0, np.int32)
        self.free_slots.append(request.slot)
        request.slot = -1
