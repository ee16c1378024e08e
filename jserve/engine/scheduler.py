"""Each step, spend a token budget over running requests (decodes, unfinished prefills) and new admissions.

Running requests go first, oldest first, each getting its next token (decode) or its next prefill chunk;
waiting requests are then admitted in (priority, arrival) order while budget, sequence slots and KV pages
last. When a running request needs a page and none is free, the least urgent running request (the worst
priority, latest admitted) is preempted by recompute: its pages are freed and it waits again at the head
of its priority class, keeping its output so far.

With prefix caching, an admitted request starts from the longest cached run of whole pages of its tokens
(never its last token, whose logits it needs), locks that path, and computes only the rest. Completed
prompt pages enter the cache after every chunk; at finish or preemption all computed pages do. Pages run
short -> the cache evicts unlocked least-recently-used pages first, and only then is a request preempted.
"""

from __future__ import annotations

import bisect
import dataclasses
import itertools
import logging
import time
from dataclasses import dataclass

import numpy as np

from jserve.engine.config import MIN_TOKEN_BUCKET, EngineConfig
from jserve.engine.page_pool import PagePool
from jserve.engine.radix_cache import PrefixMatch, RadixCache
from jserve.engine.request import Request, RequestStatus
from jserve.engine.stats import EngineStats

log = logging.getLogger("jserve")


@dataclass(frozen=True)
class ScheduledSequence:
    request: Request
    start: int  # first token computed this step (the request's num_computed_tokens)
    num_tokens: int
    first: bool = False  # the request's first chunk since admission: its per-slot state starts afresh

    @property
    def samples(self) -> bool:
        """The chunk reaches the sequence's last token, so its logits give the request's next token (read
        before the step is launched: launching changes the request)."""
        return self.start + self.num_tokens == self.request.seq_len


@dataclass(frozen=True)
class SchedulerOutput:
    sequences: list[ScheduledSequence]
    preempted: list[Request]

    @property
    def num_tokens(self) -> int:
        return sum(s.num_tokens for s in self.sequences)


LPM_MAX_QUEUE = 128  # beyond this many waiting requests, lpm ordering costs more than it saves: FCFS


class Scheduler:
    def __init__(self, config: EngineConfig, stats: EngineStats):
        self.config, self.stats = config, stats
        self.pool = PagePool(config.num_pages)
        self.cache = RadixCache(self.pool, config.page_size) if config.enable_prefix_caching else None
        self.waiting: list[Request] = []  # sorted by (priority, arrival, completion index)
        self.running: list[Request] = []  # sorted by (priority, admit order): the last is preempted first
        self.free_slots = list(range(config.max_num_seqs - 1, -1, -1))
        self._admissions = itertools.count()

    @property
    def num_unfinished(self) -> int:
        return len(self.running) + sum(not r.is_finished for r in self.waiting)

    @property
    def num_reclaimable_pages(self) -> int:
        """Pages only the prefix cache holds: cached prefixes no request is using, evicted when pages run short."""
        return self.cache.evictable_pages if self.cache is not None else 0

    @property
    def num_used_pages(self) -> int:
        """Pages requests hold (their own, and cached ones they share): what the KV usage metric counts."""
        return self.pool.num_pages - self.pool.num_free - self.num_reclaimable_pages

    def add(self, request: Request) -> None:
        bisect.insort(self.waiting, request, key=_queue_order)

    def schedule(self) -> SchedulerOutput:
        budget = self.config.max_num_batched_tokens
        scheduled: list[ScheduledSequence] = []
        preempted: list[Request] = []
        i = 0
        while i < len(self.running) and budget > 0:
            request = self.running[i]
            if request.reached_max_len:  # its last token is still in flight; it finishes when that is fetched
                i += 1
                continue
            n = min(request.seq_len - request.num_computed_tokens, budget)
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
        if not preempted:
            self._admit_waiting(scheduled, budget)
        return SchedulerOutput(self._fit_to_bucket(scheduled), preempted)

    def _admit_waiting(self, scheduled: list[ScheduledSequence], budget: int) -> None:
        self.waiting = [r for r in self.waiting if not r.is_finished]  # drop requests aborted while waiting
        prefilling = [r for r in self.running if r.num_computed_tokens < r.num_prompt_tokens]
        for request in self._admission_order():
            if budget <= 0 or not self.free_slots:
                break
            match = self._match(request)
            if self._follows(request, match, prefilling):
                continue  # a request now prefilling computes this prefix; take it from the cache after
            if match is not None:
                self.cache.lock(match.node)
            start = match.node.end if match is not None else request.num_computed_tokens
            n = min(request.seq_len - start, budget)
            matched = match.num_pages if match is not None else 0
            if not self._can_allocate(-(-(start + n) // self.config.page_size) - matched):
                if match is not None:
                    self.cache.unlock(match.node)
                break
            self.waiting.remove(request)
            self._admit(request, match)
            self._reserve_pages(request, request.num_computed_tokens + n)
            scheduled.append(ScheduledSequence(request, request.num_computed_tokens, n, first=True))
            prefilling.append(request)
            budget -= n

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
        if edge < MIN_TOKEN_BUCKET:
            return scheduled  # the lone-decode bucket: a step's fixed costs outweigh a few padded tokens
        return [*scheduled[:-1], dataclasses.replace(last, num_tokens=keep)]

    def _admission_order(self) -> list[Request]:
        """FCFS within priority; under lpm (and a short queue), the longest cached prefix first."""
        if self.config.schedule_policy != "lpm" or self.cache is None or len(self.waiting) > LPM_MAX_QUEUE:
            return list(self.waiting)
        matched = {id(r): (m.num_pages if (m := self._match(r)) is not None else 0) for r in self.waiting}
        return sorted(self.waiting, key=lambda r: (r.priority, -matched[id(r)], *_queue_order(r)[1:]))

    def _match(self, request: Request) -> PrefixMatch | None:
        """The cached prefix a request may start from, or None when it cannot use the cache: caching is
        off, or the request's penalties need every token of its history to pass through a step."""
        if self.cache is None or request.params.uses_penalties:
            return None
        return self.cache.match_prefix(request.token_buffer[: request.num_tokens - 1], request.cache_salt)

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

    def cache_computed(self, request: Request) -> None:
        """After a prefill chunk: put the request's completed prompt pages in the cache."""
        if self.cache is not None and request.cache_node is not None:
            self._cache_pages(request, min(request.num_computed_tokens, request.num_prompt_tokens))

    def _cache_pages(self, request: Request, num_tokens: int) -> None:
        """Insert the request's whole pages up to `num_tokens` and move its lock to where they end."""
        full = num_tokens // self.config.page_size
        if full * self.config.page_size <= request.cache_node.end:
            return
        tokens = request.token_buffer[: full * self.config.page_size]
        node = self.cache.insert(tokens, request.pages[:full], request.cache_salt)
        self.cache.lock(node)
        self.cache.unlock(request.cache_node)
        request.cache_node = node

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

    def _admit(self, request: Request, match: PrefixMatch | None) -> None:
        request.status = RequestStatus.RUNNING
        request.slot = self.free_slots.pop()
        request.admit_index = next(self._admissions)
        if self.cache is not None and match is None:  # it will not read the cache, but its pages go in
            request.cache_node = self.cache.root(request.cache_salt)
        if match is not None:  # start from the cached prefix (its path already locked)
            request.pages = match.pages.copy()
            self.pool.share(request.pages)
            request.cache_node = match.node
            request.num_computed_tokens = match.node.end
        if request.num_preemptions == 0:
            request.num_cached_tokens = request.num_computed_tokens
            if match is not None:
                self.stats.prefix_cache_queries += request.num_prompt_tokens
                self.stats.prefix_cache_hits += request.num_computed_tokens
        if request.first_scheduled_time is None:
            request.first_scheduled_time = time.monotonic()
        keys = [(r.priority, r.admit_index) for r in self.running]
        self.running.insert(bisect.bisect(keys, (request.priority, request.admit_index)), request)

    def _pages_needed(self, request: Request, num_tokens: int) -> int:
        return -(-num_tokens // self.config.page_size) - len(request.pages)

    def _can_allocate(self, num_pages: int) -> bool:
        """Whether `num_pages` can be had, evicting unlocked cached pages if the free ones fall short."""
        if num_pages > self.pool.num_free and self.cache is not None:
            self.cache.evict(num_pages - self.pool.num_free)
        return num_pages <= self.pool.num_free

    def _reserve_pages(self, request: Request, num_tokens: int) -> bool:
        needed = self._pages_needed(request, num_tokens)
        if needed <= 0:
            return True
        if not self._can_allocate(needed):
            return False
        request.pages = np.concatenate([request.pages, self.pool.allocate(needed)])
        return True

    def _preempt(self, request: Request) -> None:
        self._release(request)
        self.running.remove(request)
        request.status = RequestStatus.PREEMPTED
        request.num_computed_tokens = 0
        request.num_preemptions += 1
        bisect.insort(self.waiting, request, key=_queue_order)
        log.debug("preempted %s (%d tokens to recompute)", request.request_id, request.num_tokens)

    def _release(self, request: Request) -> None:
        """Give back a running request's pages and slot; with caching, its computed pages stay cached."""
        if request.cache_node is not None:
            self._cache_pages(request, request.num_computed_tokens)
            self.cache.unlock(request.cache_node)
            request.cache_node = None
        self.pool.release(request.pages)
        request.pages = np.zeros(0, np.int32)
        self.free_slots.append(request.slot)
        request.slot = -1


def _queue_order(request: Request) -> tuple[int, int, int]:
    return request.priority, request.arrival_index, request.index
