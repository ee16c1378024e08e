"""Scheduler: admission and preemption policy, and each step's plan: which requests compute which tokens.

Each step spends a token budget over running requests (decodes, unfinished prefills) and new admissions.

Running requests go first, oldest first, each getting its next token (decode) or its next prefill chunk;
waiting requests are then admitted in (priority, arrival) order while budget, sequence slots and KV pages
last. When a running request needs a page and none is free, the least urgent running request (the worst
priority, latest admitted) is preempted by recompute: its pages are freed and it waits again at the head
of its priority class, keeping its output so far.

With prefix caching, an admitted request starts from the longest cached run of whole pages of its tokens
(never its last token, whose logits it needs), locks that path, and computes only the rest. Completed
prompt pages enter the cache after every chunk; at finish or preemption all computed pages do. Pages run
short -> the cache evicts unlocked least-recently-used pages first, and only then is a request preempted.

With speculation (engine/speculation.py), a decoding request may add extra tokens to its step for the step to
verify, budget and pages permitting, and a sampling request may ask its step to propose those of its next step,
holding pages for them.

Contract: the Scheduler owns the waiting and running queues and is the only writer of a request's status,
admission order, preemption count, cache-hit count and schedule/finish times. It changes slots only through
SequenceSlots (slots.py) and pages only through KVManager (kv_manager.py).
"""

from __future__ import annotations

import bisect
import dataclasses
import itertools
import logging
import time
from dataclasses import dataclass, field
from typing import Protocol

import numpy as np

from jserve.engine.config import MIN_TOKEN_BUCKET, EngineConfig, SchedulePolicy
from jserve.engine.kv_manager import KVManager
from jserve.engine.page_pool import PagePool
from jserve.engine.radix_cache import PrefixMatch
from jserve.engine.request import Request, RequestStatus
from jserve.engine.slots import SequenceSlots
from jserve.engine.speculation import Speculation
from jserve.engine.stats import EngineStats

log = logging.getLogger("jserve")

NO_DRAFTS = np.zeros(0, np.int32)


@dataclass(slots=True)  # (made for every running request every step: slots, not frozen, halve that cost)
class ScheduledSequence:
    request: Request
    start: int  # first token computed this step (the request's num_computed_tokens)
    num_tokens: int
    first: bool = False  # the request's first chunk since admission: its per-slot state starts afresh
    # Draft tokens to verify, the chunk's last num_tokens counts them too (after the request's latest token).
    drafts: np.ndarray = field(default_factory=lambda: NO_DRAFTS)
    proposes: bool = False  # the step proposes the extra tokens of the request's next step
    # The chunk reaches the sequence's last token, so its logits give the request's next token. Worked out
    # once, as the step is planned: launching changes the request, and several readers ask every step.
    samples: bool = field(init=False)

    def __post_init__(self):
        self.samples = self.start + self.num_tokens - len(self.drafts) == self.request.seq_len

    @property
    def token_ids(self) -> np.ndarray:
        """The chunk's tokens: the request's own, then its drafts."""
        end = self.start + self.num_tokens - len(self.drafts)
        own = self.request.token_buffer[self.start : end]
        return np.concatenate([own, self.drafts]) if len(self.drafts) else own


def verify_row_starts(sequences: list[ScheduledSequence]) -> np.ndarray:
    """Each sequence's first verify row in its step: the step verifies the drafts in sequence order."""
    return np.cumsum([0] + [len(s.drafts) for s in sequences])[:-1]


def proposing_rows(sequences: list[ScheduledSequence]) -> dict[int, int]:
    """{sequence index: its row of the step's proposals}, in sequence order."""
    return {i: row for row, i in enumerate(i for i, s in enumerate(sequences) if s.proposes)}


class AdmissionGate(Protocol):
    """What limits admission beyond sequence slots and KV pages: asked before a request is admitted, told when
    one is admitted (it runs from then on) and when one stops running (finished or preempted)."""

    def can_admit(self, request: Request) -> bool: ...

    def admitted(self, request: Request) -> None: ...

    def released(self, request: Request) -> None: ...


class _OpenGate:
    def can_admit(self, request: Request) -> bool:
        return True

    def admitted(self, request: Request) -> None:
        pass

    def released(self, request: Request) -> None:
        pass


OPEN_GATE = _OpenGate()


@dataclass(frozen=True)
class SchedulerOutput:
    sequences: list[ScheduledSequence]
    preempted: list[Request]

    @property
    def num_tokens(self) -> int:
        return sum(s.num_tokens for s in self.sequences)


LPM_MAX_QUEUE = 128  # beyond this many waiting requests, lpm ordering costs more than it saves: FCFS


class Scheduler:
    def __init__(
        self,
        config: EngineConfig,
        stats: EngineStats,
        speculation: Speculation | None = None,
        gate: AdmissionGate | None = None,
    ):
        """`gate`: a limit on which requests may run together beyond slots and pages (lora/slots.py: the
        adapters of running requests must fit the device's adapter slots)."""
        self.config, self.stats, self.speculation = config, stats, speculation
        self.gate = gate or OPEN_GATE
        self.slots = SequenceSlots(config.max_num_seqs)
        self.kv = KVManager(config)
        self.waiting: list[Request] = []  # sorted by (priority, arrival, completion index)
        self.running: list[Request] = []  # sorted by (priority, admit order): the last is preempted first
        self._admissions = itertools.count()
        # Admit no request that has not run yet (the engine is waiting for the ones in flight to finish, e.g.
        # to change weights); preempted ones still resume.
        self.hold_new = False

    @property
    def num_unfinished(self) -> int:
        return len(self.running) + len(self.waiting)

    @property
    def num_in_flight(self) -> int:
        """Requests that have started: running, or preempted and waiting to resume."""
        return len(self.running) + sum(r.status is RequestStatus.PREEMPTED for r in self.waiting)

    # KV usage, as the engine's log line and the server's metrics read it.

    @property
    def pool(self) -> PagePool:
        return self.kv.pool

    @property
    def num_reclaimable_pages(self) -> int:
        return self.kv.num_reclaimable_pages

    @property
    def num_used_pages(self) -> int:
        return self.kv.num_used_pages

    def add(self, request: Request) -> None:
        bisect.insort(self.waiting, request, key=_queue_order)

    def schedule(self) -> SchedulerOutput:
        budget = self.config.max_num_batched_tokens
        scheduled: list[ScheduledSequence] = []
        preempted: list[Request] = []
        speculating = self.speculation is not None and self.speculation.active(len(self.running))
        i, reserve, holds, running = 0, self.kv.reserve, self.kv.holds, self.running
        while i < len(running) and budget > 0:
            request = running[i]
            i += 1
            seq_len = request.seq_len
            if seq_len >= request.max_len:  # its last token is still in flight; it finishes when that is fetched
                continue
            computed = request.num_computed_tokens
            n = min(seq_len - computed, budget)
            drafts = self._extra_tokens(request, budget - n) if speculating else NO_DRAFTS
            if len(drafts) and not reserve(request, computed + n + len(drafts)):
                drafts = NO_DRAFTS  # pages are short: no speculating
            if not holds(request, computed + n):  # (most steps fit the pages a request holds)
                while not reserve(request, computed + n):
                    victim = running[-1]
                    self._preempt(victim)
                    preempted.append(victim)
                    if victim is request:
                        break
                if request.status is not RequestStatus.RUNNING:
                    break
            proposes = speculating and self._proposes(request, n, len(drafts))
            # (positional: one per running request per step)
            scheduled.append(ScheduledSequence(request, computed, n + len(drafts), False, drafts, proposes))
            budget -= n + len(drafts)

        if self.speculation is not None:  # drafts only where they pay; the budget they free goes to admissions
            planned = self.speculation.plan(scheduled)
            if planned is not scheduled:  # (the same list when nothing was dropped)
                scheduled = planned
                budget = self.config.max_num_batched_tokens - sum(s.num_tokens for s in scheduled)
        # Admit only when nothing had to be preempted: pages are short.
        if not preempted:
            self._admit_waiting(scheduled, budget)
        return SchedulerOutput(self._fit_to_bucket(scheduled), preempted)

    def _extra_tokens(self, request: Request, room: int) -> np.ndarray:
        """Extra tokens for a decoding request's step to verify, as many as fit the step's budget and the
        request's max_tokens and max_model_len (the step yields up to one token more than it verifies)."""
        if request.num_computed_tokens != request.seq_len - 1:
            return NO_DRAFTS  # not decoding
        limit = min(room, self.config.max_model_len - 1 - request.seq_len)
        if request.params.max_tokens is not None:
            limit = min(limit, request.params.max_tokens - request.num_output_tokens - 1)
        return self.speculation.extra_tokens(request, limit)

    def _proposes(self, request: Request, num_tokens: int, num_drafts: int) -> bool:
        """Whether the step proposes the next step's extra tokens for a request that computes `num_tokens` of
        its tokens and `num_drafts` drafts: it samples, and pages hold the proposals' positions."""
        ahead = self.speculation.lookahead(request)
        end = request.num_computed_tokens + num_tokens
        if not ahead or end < request.seq_len:  # (a prefill chunk before the last does not sample)
            return False
        reach = end + num_drafts + ahead
        return reach <= self.config.max_model_len and self.kv.reserve(request, reach)

    def _admit_waiting(self, scheduled: list[ScheduledSequence], budget: int) -> None:
        if not self.waiting:
            return
        prefilling = [r for r in self.running if r.num_computed_tokens < r.num_prompt_tokens]
        for request in self._admission_order():
            if budget <= 0 or not self.slots.num_free:
                break
            if self.hold_new and request.status is not RequestStatus.PREEMPTED:
                continue
            if not self.gate.can_admit(request):
                continue  # (its adapter waits for a slot; requests behind it may run)
            match = self.kv.match(request)
            if self._follows(request, match, prefilling):
                continue  # a request now prefilling computes this prefix; take it from the cache after
            start = match.node.end if match is not None else 0  # a waiting request holds no K/V
            n = min(request.seq_len - start, budget)
            if not self.kv.admit(request, match, start + n):
                break
            self.waiting.remove(request)
            self._admit(request, cached=match is not None)
            # (running now counts it: no more than disable_by_batch_size requests ever propose in one step)
            speculating = self.speculation is not None and self.speculation.active(len(self.running))
            proposes = speculating and self._proposes(request, n, 0)
            scheduled.append(ScheduledSequence(request, start, n, first=True, proposes=proposes))
            prefilling.append(request)
            budget -= n

    def _fit_to_bucket(self, scheduled: list[ScheduledSequence]) -> list[ScheduledSequence]:
        """Padded tokens cost as much as real ones, so a last prefill chunk that spills just past a token
        bucket is cut back to that bucket's edge when it keeps at least half its tokens; the rest then
        fills the padding of a following (usually decode-only) step."""
        if not scheduled:
            return scheduled
        last = scheduled[-1]
        total, buckets = sum(s.num_tokens for s in scheduled), self.config.token_buckets
        if total in buckets:
            return scheduled  # it fills its bucket: nothing is padded
        edge = max((b for b in buckets if b < total), default=0)
        keep = last.num_tokens - (total - edge)
        if last.request.num_computed_tokens >= last.request.num_prompt_tokens or 2 * keep < last.num_tokens:
            return scheduled  # a decode, or too little would be left
        if edge < MIN_TOKEN_BUCKET:
            return scheduled  # the lone-decode bucket: a step's fixed costs outweigh a few padded tokens
        return [*scheduled[:-1], dataclasses.replace(last, num_tokens=keep, proposes=False)]

    def _admission_order(self) -> list[Request]:
        """FCFS within priority; under lpm (and a short queue), the longest cached prefix first. The lookups
        here only peek: a request looked at but not admitted leaves the cache as it was."""
        lpm = self.config.schedule_policy == SchedulePolicy.LPM and self.config.enable_prefix_caching
        if not lpm or len(self.waiting) > LPM_MAX_QUEUE:
            return list(self.waiting)
        matched = {id(r): self.kv.peek(r) for r in self.waiting}
        return sorted(self.waiting, key=lambda r: (r.priority, -matched[id(r)], *_queue_order(r)[1:]))

    def _follows(self, request: Request, match: PrefixMatch | None, prefilling: list[Request]) -> bool:
        """Whether a request now prefilling shares whole pages with `request` beyond its cached match (as
        n > 1 siblings and prompts sent together do): then it waits and reuses those pages instead."""
        if match is None:
            return False
        page, tokens = self.config.page_size, request.token_buffer[: request.num_tokens - 1]
        end = (match.num_pages + 1) * page  # sharing one more whole page than the cache holds is enough
        if len(tokens) < end:
            return False
        for other in prefilling:
            if other.cache_salt != request.cache_salt or other.num_prompt_tokens < end:
                continue
            head = other.token_buffer[:end]
            # The page past the match first: it tells most prompts apart at a page's cost.
            if np.array_equal(tokens[end - page : end], head[end - page :]) and np.array_equal(tokens[:end], head):
                return True
        return False

    def finish(self, request: Request, reason: str, stop_reason: int | str | None = None) -> None:
        """End a request wherever it is; its pages and slot return to the pools."""
        if request.is_finished:
            return
        if self.speculation is not None:
            self.speculation.forget(request)
        if request.status is RequestStatus.RUNNING:
            self._release(request)
        else:  # waiting (aborted, or failed before it ran)
            self.waiting.remove(request)
        request.status = RequestStatus.FINISHED
        request.finish_reason, request.stop_reason = reason, stop_reason
        request.finish_time = time.monotonic()

    def _admit(self, request: Request, cached: bool) -> None:
        """A request whose pages KVManager.admit has set up starts running."""
        request.status = RequestStatus.RUNNING
        self.slots.assign(request)
        request.admit_index = next(self._admissions)
        self.gate.admitted(request)
        if request.num_preemptions == 0:
            request.num_cached_tokens = request.num_computed_tokens
            if cached:
                self.stats.prefix_cache_queries += request.num_prompt_tokens
                self.stats.prefix_cache_hits += request.num_computed_tokens
        if request.first_scheduled_time is None:
            request.first_scheduled_time = time.monotonic()
        keys = [(r.priority, r.admit_index) for r in self.running]
        self.running.insert(bisect.bisect(keys, (request.priority, request.admit_index)), request)

    def _preempt(self, request: Request) -> None:
        self._release(request)
        request.status = RequestStatus.PREEMPTED
        request.num_preemptions += 1
        bisect.insort(self.waiting, request, key=_queue_order)
        log.debug("preempted %s (%d tokens to recompute)", request.request_id, request.num_tokens)

    def _release(self, request: Request) -> None:
        """A running request stops running: its pages (cached, with caching) and slot go back."""
        self.kv.free(request)
        self.slots.release(request)
        self.gate.released(request)
        self.running.remove(request)

    def check_idle(self) -> None:
        """Nothing runs, and every slot and page is back (each page free or cached, unlocked), with every
        prefix-cache invariant checked: a walk of the whole tree, for tests and --debug-checks."""
        assert not self.running, "a request still runs"
        self.slots.check_idle()
        self.kv.check_idle()


def _queue_order(request: Request) -> tuple[int, int, int]:
    return request.priority, request.arrival_index, request.index
