"""KVManager: the KV pages of each running request, and the prefix cache through which they are shared.

Contract: the only code that allocates, shares, frees or caches pages for a request, and the only writer of
Request.pages, Request.cache_node and Request.num_computed_tokens. It owns the PagePool and (with prefix
caching) the RadixCache; others may read them (usage metrics, checks) but never change them.

A running request holds one pool reference on each page in `pages`, which cover at least its computed
tokens. With caching it also holds a lock on `cache_node`, the deepest cached node its pages reach (its
salt's root while none are cached), so eviction leaves its cached prefix be. A request that is not running
holds nothing: no pages, no lock, no computed tokens.
"""

from __future__ import annotations

import numpy as np

from jserve.engine.config import EngineConfig
from jserve.engine.page_pool import PagePool
from jserve.engine.radix_cache import PrefixMatch, RadixCache
from jserve.engine.request import Request


class KVManager:
    def __init__(self, config: EngineConfig):
        self.page_size = config.page_size
        self.pool = PagePool(config.num_pages)
        self.cache = RadixCache(self.pool, config.page_size) if config.enable_prefix_caching else None

    @property
    def num_reclaimable_pages(self) -> int:
        """Pages only the prefix cache holds: cached prefixes no request is using, evicted when pages run short."""
        return self.cache.evictable_pages if self.cache is not None else 0

    @property
    def num_used_pages(self) -> int:
        """Pages requests hold (their own, and cached ones they share): what the KV usage metric counts."""
        return self.pool.num_pages - self.pool.num_free - self.num_reclaimable_pages

    # --- prefix lookups --------------------------------------------------------------------------

    def peek(self, request: Request) -> int:
        """How many pages match(request) would find, looked up without touching the cache: for ranking a
        queue, where looking must not make a prefix recently used."""
        if not self._reads_cache(request):
            return 0
        return self.cache.peek_prefix(request.token_buffer[: request.num_tokens - 1], request.cache_salt)

    def match(self, request: Request) -> PrefixMatch | None:
        """The cached prefix a request may start from: the longest run of cached whole pages of its tokens
        but the last (whose logits it needs), stamped recently used and ending at a node it can lock; None
        when it cannot use the cache."""
        if not self._reads_cache(request):
            return None
        return self.cache.match_prefix(request.token_buffer[: request.num_tokens - 1], request.cache_salt)

    def _reads_cache(self, request: Request) -> bool:
        """Caching is on, and neither the request's penalties nor its prompt logprobs need every token of its
        history to pass through a step (scoring a cached prefix again costs what computing it costs, and a
        request that scores its prompt is usually alone in reading it)."""
        params = request.params
        return self.cache is not None and not params.uses_penalties and params.prompt_logprobs is None

    # --- a request's pages -----------------------------------------------------------------------

    def admit(self, request: Request, match: PrefixMatch | None, num_tokens: int) -> bool:
        """Start a waiting request from `match` (its cached prefix, or None) with pages for its first
        `num_tokens` tokens. False, and the request untouched, when pages fall short even after eviction."""
        matched = match.num_pages if match is not None else 0
        if match is not None:
            self.cache.lock(match.node)  # before any eviction, which must leave the match be
        if not self._can_allocate(-(-num_tokens // self.page_size) - matched):
            if match is not None:
                self.cache.unlock(match.node)
            return False
        if match is not None:  # start from the cached prefix (its path now locked)
            request.pages = match.pages.copy()
            self.pool.share(request.pages)
            request.cache_node = match.node
            request.num_computed_tokens = match.node.end
        elif self.cache is not None:  # it will not read the cache, but its pages go in
            request.cache_node = self.cache.root(request.cache_salt)
        return self.reserve(request, num_tokens)

    def holds(self, request: Request, num_tokens: int) -> bool:
        """The request's pages already cover its first `num_tokens` tokens (most steps: no reserve needed)."""
        return num_tokens <= len(request.pages) * self.page_size

    def reserve(self, request: Request, num_tokens: int) -> bool:
        """Pages for a running request's first `num_tokens` tokens, evicting unlocked cached pages if the
        free ones fall short; False (nothing allocated) when that is not enough."""
        if self.holds(request, num_tokens):
            return True
        needed = -(-num_tokens // self.page_size) - len(request.pages)
        if not self._can_allocate(needed):
            return False
        request.pages = np.concatenate([request.pages, self.pool.allocate(needed)])
        return True

    def drop_cache(self) -> int:
        """Forget every cached prefix no request holds (their K/V came from weights no longer served); returns
        how many pages went back to the pool."""
        return self.cache.evict(self.cache.evictable_pages) if self.cache is not None else 0

    def advance(self, request: Request, num_tokens: int) -> None:
        """A launched step writes the K/V of the request's next `num_tokens` tokens. Prompt pages it
        completes enter the cache now, so requests admitted by the next step already share them."""
        prefilling = request.num_computed_tokens < request.num_prompt_tokens
        request.num_computed_tokens += num_tokens
        if prefilling and request.cache_node is not None:
            self._cache_pages(request, min(request.num_computed_tokens, request.num_prompt_tokens))

    def reject(self, request: Request, num_tokens: int) -> None:
        """The request's last `num_tokens` computed tokens were drafts the step rejected: they no longer count
        as computed (the next step writes over their K/V), and pages wholly past the rest are released."""
        request.num_computed_tokens -= num_tokens
        keep = -(-request.num_computed_tokens // self.page_size)
        if keep < len(request.pages):
            self.pool.release(request.pages[keep:])
            request.pages = request.pages[:keep]

    def free(self, request: Request) -> None:
        """Give back a running request's pages (it finished or is preempted); with caching, its computed
        whole pages stay cached for others and its lock is dropped. Only tokens the host knows are cached: a
        token still in flight, or a draft being verified, has K/V whose token id is not known yet."""
        if request.cache_node is not None:
            self._cache_pages(request, min(request.num_computed_tokens, request.num_tokens))
            self.cache.unlock(request.cache_node)
            request.cache_node = None
        self.pool.release(request.pages)
        request.pages = np.zeros(0, np.int32)
        request.num_computed_tokens = 0

    def _can_allocate(self, num_pages: int) -> bool:
        """Whether `num_pages` can be had, evicting unlocked cached pages if the free ones fall short."""
        if num_pages > self.pool.num_free and self.cache is not None:
            self.cache.evict(num_pages - self.pool.num_free)
        return num_pages <= self.pool.num_free

    def _cache_pages(self, request: Request, num_tokens: int) -> None:
        """Insert the request's whole pages up to `num_tokens` and move its lock to where they end."""
        full = num_tokens // self.page_size
        if full * self.page_size <= request.cache_node.end:
            return
        tokens = request.token_buffer[: full * self.page_size]
        node = self.cache.insert(tokens, request.pages[:full], request.cache_salt)
        self.cache.lock(node)
        self.cache.unlock(request.cache_node)
        request.cache_node = node

    # --- checks ----------------------------------------------------------------------------------

    def check_idle(self) -> None:
        """With no request running, each page is free or cached and unlocked, and the cache keeps its every
        invariant. A walk of the whole tree (a few microseconds a node): for tests and --debug-checks."""
        if self.cache is None:
            assert self.pool.num_free == self.pool.num_pages and not self.pool.ref_counts.any(), "pages leaked"
            return
        self.cache.check_integrity([])
        assert self.cache.evictable_pages == self.cache.num_pages, "a cached page is still locked"
        assert self.pool.num_free + self.cache.num_pages == self.pool.num_pages, "pages leaked"
