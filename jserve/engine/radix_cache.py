"""RadixCache: a radix tree over token ids whose nodes own KV pages, so requests share computed prefixes.

Edges hold whole pages only (a partly filled page is never shared), so every edge label is a multiple of
page_size tokens and a node's children are keyed by their first page's tokens. Ownership is by the page
pool's reference counts: the tree holds one reference on each page it owns, and every request holds one
on each page in its page table, shared or not. A request using a cached path locks it (lock_ref counts
along the path to the root) so eviction, which frees least-recently-used unlocked leaves, leaves it be.
A `salt` gives each tenant a tree of its own: prefixes are never shared across salts.
"""

from __future__ import annotations

import heapq
import itertools
from collections.abc import Hashable, Iterable
from dataclasses import dataclass, field

import numpy as np

from jserve.engine.page_pool import PagePool


@dataclass(eq=False)
class Node:
    tokens: np.ndarray  # the edge label from the parent: len(pages) * page_size token ids
    pages: np.ndarray
    parent: Node | None
    children: dict[tuple[int, ...], Node] = field(default_factory=dict)
    lock_ref: int = 0
    last_access: int = 0

    @property
    def end(self) -> int:
        """Tokens from the root through this node's edge."""
        return len(self.tokens) + (self.parent.end if self.parent is not None else 0)

    @property
    def is_root(self) -> bool:
        return self.parent is None


@dataclass(frozen=True)
class PrefixMatch:
    node: Node  # the deepest node of the match (a root when nothing matched)
    pages: np.ndarray  # the matched pages, in order

    @property
    def num_pages(self) -> int:
        return len(self.pages)


class RadixCache:
    def __init__(self, pool: PagePool, page_size: int):
        self.pool, self.page_size = pool, page_size
        self.roots: dict[Hashable, Node] = {}
        self.num_pages = 0  # pages the tree holds
        self.evictable_pages = 0  # of those, pages in unlocked nodes
        self._clock = itertools.count(1)

    # --- lookups and inserts ---------------------------------------------------------------------

    def match_prefix(self, tokens: np.ndarray, salt: Hashable = None) -> PrefixMatch:
        """The longest cached run of whole pages that `tokens` starts with. A match ending inside an edge
        splits it there, so the match always ends at a node (which the caller may lock)."""
        node, pages, pos = self.root(salt), [], 0
        now = next(self._clock)
        node.last_access = now
        while pos + self.page_size <= len(tokens):
            child = node.children.get(self._key(tokens, pos))
            if child is None:
                break
            n = self._common_pages(child.tokens, tokens[pos:])
            if n < len(child.pages):
                child = self._split(child, n)
            child.last_access = now
            pages.append(child.pages)
            pos += n * self.page_size
            node = child
        return PrefixMatch(node, np.concatenate(pages) if pages else np.zeros(0, np.int32))

    def peek_prefix(self, tokens: np.ndarray, salt: Hashable = None) -> int:
        """How many pages match_prefix(tokens, salt) would match, found without touching the tree: no edge
        split, no access stamp, no root made for a new salt. For ranking many requests (ordering a queue),
        where a look must not make the prefixes looked at recently used."""
        node, pos = self.roots.get(salt), 0
        while node is not None and pos + self.page_size <= len(tokens):
            child = node.children.get(self._key(tokens, pos))
            if child is None:
                break
            n = self._common_pages(child.tokens, tokens[pos:])
            pos += n * self.page_size
            node = child if n == len(child.pages) else None  # a match ending inside an edge ends there
        return pos // self.page_size

    def insert(self, tokens: np.ndarray, pages: np.ndarray, salt: Hashable = None) -> Node:
        """Cache `pages` as holding the K/V of `tokens` (whole pages: len(tokens) == len(pages) * page_size).
        Parts already cached keep the tree's pages (the caller's copies stay the caller's); new parts are
        added and the tree takes a reference on their pages. Returns the node where `tokens` ends."""
        assert len(tokens) == len(pages) * self.page_size, "insert takes whole pages"
        match = self.match_prefix(tokens, salt)
        node, done = match.node, match.num_pages
        if done < len(pages):
            leaf = Node(np.array(tokens[done * self.page_size :], np.int32), np.array(pages[done:], np.int32), node,
                        last_access=next(self._clock))  # fmt: skip
            node.children[self._key(leaf.tokens, 0)] = leaf
            self.pool.share(leaf.pages)
            self.num_pages += len(leaf.pages)
            self.evictable_pages += len(leaf.pages)  # a new leaf starts unlocked
            node = leaf
        return node

    # --- locks -----------------------------------------------------------------------------------

    def lock(self, node: Node) -> None:
        for n in self._path(node):
            if n.lock_ref == 0:
                self.evictable_pages -= len(n.pages)
            n.lock_ref += 1

    def unlock(self, node: Node) -> None:
        for n in self._path(node):
            assert n.lock_ref > 0, "unlock without lock"
            n.lock_ref -= 1
            if n.lock_ref == 0:
                self.evictable_pages += len(n.pages)

    # --- eviction --------------------------------------------------------------------------------

    def evict(self, num_pages: int) -> int:
        """Let go of `num_pages` pages (or all unlocked ones, if fewer) from the ends of least recently used
        unlocked leaves; returns how many. Each returns to the pool unless a request still holds it."""
        leaves = [(n.last_access, id(n), n) for n in self._nodes() if not n.children and not n.lock_ref]
        heapq.heapify(leaves)
        released = 0
        while released < num_pages and leaves:
            _, _, leaf = heapq.heappop(leaves)
            keep = len(leaf.pages) - (num_pages - released)
            if keep > 0:  # only the leaf's last pages are needed: keep its head cached
                self._split(leaf, keep)
            parent = leaf.parent
            del parent.children[self._key(leaf.tokens, 0)]
            self.pool.release(leaf.pages)
            released += len(leaf.pages)
            self.num_pages -= len(leaf.pages)
            self.evictable_pages -= len(leaf.pages)
            if not parent.is_root and not parent.children and not parent.lock_ref:
                heapq.heappush(leaves, (parent.last_access, id(parent), parent))
        return released

    # --- checks ----------------------------------------------------------------------------------

    def check_integrity(self, request_pages: Iterable[np.ndarray] | None = None) -> None:
        """Every invariant, checked the slow way. Given the page lists of all requests, also checks that
        each page's reference count is exactly its holders (the tree + each request; 0 for a page nobody
        holds) and that free + held == total. The walk costs a few microseconds a node; page counts are
        numpy."""
        tree_pages = [np.zeros(0, np.int32)]
        evictable = 0
        for node in self._nodes():
            assert len(node.tokens) == len(node.pages) * self.page_size and len(node.pages) > 0
            assert node.parent.children[self._key(node.tokens, 0)] is node
            assert node.lock_ref >= max((c.lock_ref for c in node.children.values()), default=0)
            tree_pages.append(node.pages)
            evictable += 0 if node.lock_ref else len(node.pages)
        cached = np.concatenate(tree_pages)
        assert len(cached) == self.num_pages
        assert np.bincount(cached, minlength=self.pool.num_pages).max(initial=0) <= 1, "a page cached twice"
        assert evictable == self.evictable_pages
        refs = self.pool.ref_counts
        assert np.all(refs[cached] >= 1), "the tree holds a page the pool thinks is free"
        if request_pages is not None:
            holders = np.bincount(np.concatenate([cached, *request_pages]), minlength=self.pool.num_pages)
            assert np.array_equal(refs, holders), "reference counts differ from holders"
            assert self.pool.num_free + np.count_nonzero(holders) == self.pool.num_pages, "pages leaked"

    # --- internals -------------------------------------------------------------------------------

    def root(self, salt: Hashable) -> Node:
        if salt not in self.roots:
            self.roots[salt] = Node(np.zeros(0, np.int32), np.zeros(0, np.int32), None)
        return self.roots[salt]

    def _key(self, tokens: np.ndarray, pos: int) -> tuple[int, ...]:
        return tuple(tokens[pos : pos + self.page_size].tolist())

    def _common_pages(self, edge: np.ndarray, tokens: np.ndarray) -> int:
        """Whole pages `edge` and `tokens` share from their start."""
        n = min(len(edge), len(tokens) // self.page_size * self.page_size)
        differ = np.flatnonzero(edge[:n] != tokens[:n])
        return (differ[0] if len(differ) else n) // self.page_size

    def _split(self, child: Node, num_pages: int) -> Node:
        """Put a node holding child's first `num_pages` pages between child and its parent."""
        cut = num_pages * self.page_size
        middle = Node(child.tokens[:cut], child.pages[:num_pages], child.parent, lock_ref=child.lock_ref,
                      last_access=child.last_access)  # fmt: skip
        child.parent.children[self._key(child.tokens, 0)] = middle
        child.tokens, child.pages, child.parent = child.tokens[cut:], child.pages[num_pages:], middle
        middle.children[self._key(child.tokens, 0)] = child
        return middle

    def _path(self, node: Node):
        while not node.is_root:
            yield node
            node = node.parent

    def _nodes(self):
        stack = [c for root in self.roots.values() for c in root.children.values()]
        while stack:
            node = stack.pop()
            yield node
            stack.extend(node.children.values())
