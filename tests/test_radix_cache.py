"""RadixCache on its own: matching, inserting, splitting, locks, LRU eviction, salts, and every invariant
after random operation sequences, against a naive model (a dict from each cached page-prefix to its page)."""

import numpy as np
from hypothesis import given, settings
from hypothesis import strategies as st

from jserve.engine.page_pool import PagePool
from jserve.engine.radix_cache import RadixCache

PAGE = 2


def make_cache(pages: int = 64) -> RadixCache:
    return RadixCache(PagePool(pages), PAGE)


def compute(cache: RadixCache, tokens: list[int], salt=None) -> np.ndarray:
    """A request computing `tokens` from scratch: fresh pages for its whole pages, inserted, then released."""
    tokens = np.array(tokens[: len(tokens) // PAGE * PAGE], np.int32)
    pages = cache.pool.allocate(len(tokens) // PAGE)
    cache.insert(tokens, pages, salt)
    cache.pool.release(pages)
    return pages


def dump(cache: RadixCache) -> tuple:
    """Everything the tree holds, node by node (edge, pages, lock count, access stamp), and its counters."""

    def node(n):
        children = tuple((key, node(child)) for key, child in n.children.items())
        return n.tokens.tobytes(), n.pages.tobytes(), n.lock_ref, n.last_access, children

    return tuple((salt, node(root)) for salt, root in cache.roots.items()), cache.num_pages, cache.evictable_pages


def test_match_returns_the_longest_whole_page_prefix():
    cache = make_cache()
    pages = compute(cache, [1, 2, 3, 4, 5, 6])
    assert cache.match_prefix(np.array([1, 2, 3, 4, 5, 6, 7])).pages.tolist() == pages.tolist()
    assert cache.match_prefix(np.array([1, 2, 3, 4, 9, 9])).pages.tolist() == pages[:2].tolist()
    assert cache.match_prefix(np.array([1, 2, 3])).pages.tolist() == pages[:1].tolist()  # a partial page never
    assert cache.match_prefix(np.array([2, 1])).num_pages == 0
    cache.check_integrity([])


def test_a_match_inside_an_edge_splits_it():
    cache = make_cache()
    compute(cache, [1, 2, 3, 4, 5, 6])
    match = cache.match_prefix(np.array([1, 2, 3, 4, 7, 7]))
    assert match.num_pages == 2 and len(match.node.children) == 1
    compute(cache, [1, 2, 3, 4, 7, 7])  # a branch off the split point
    assert len(match.node.children) == 2
    cache.check_integrity([])


def test_peek_counts_what_match_would_and_leaves_the_tree_untouched():
    cache = make_cache()
    compute(cache, [1, 2, 3, 4, 5, 6])
    compute(cache, [1, 2, 7, 7])
    queries = [[1, 2, 3, 4, 5, 6, 7], [1, 2, 3, 4, 9, 9], [1, 2, 3], [1, 2, 7, 7], [2, 1], [1], []]
    before = dump(cache)
    peeked = [cache.peek_prefix(np.array(q, np.int32)) for q in queries]
    assert cache.peek_prefix(np.array([1, 2], np.int32), salt="unseen") == 0
    assert dump(cache) == before
    assert peeked == [cache.match_prefix(np.array(q, np.int32)).num_pages for q in queries] == [3, 2, 1, 2, 0, 0, 0]
    assert dump(cache) != before  # the same lookups by match_prefix split [1, 2, 3, 4, 5, 6] and stamped times
    cache.check_integrity([])


def test_insert_keeps_cached_pages_and_adds_the_rest():
    cache = make_cache()
    first = compute(cache, [1, 2, 3, 4])
    second = cache.pool.allocate(3)
    cache.insert(np.array([1, 2, 3, 4, 5, 6]), second)
    assert cache.match_prefix(np.array([1, 2, 3, 4, 5, 6])).pages.tolist() == [*first.tolist(), second[2]]
    assert cache.num_pages == 3
    cache.check_integrity([second])  # the request still holds its own three pages


def test_locked_paths_survive_eviction_and_lru_goes_first():
    cache = make_cache()
    old = compute(cache, [1, 1, 1, 1])
    kept = compute(cache, [2, 2, 2, 2])
    new = compute(cache, [3, 3, 3, 3])
    match = cache.match_prefix(np.array([2, 2, 2, 2]))
    cache.lock(match.node)
    cache.pool.share(match.pages)  # the request that locked it holds its pages
    assert cache.evictable_pages == 4
    assert cache.evict(2) == 2  # the least recently used unlocked leaf
    assert cache.match_prefix(np.array([1, 1, 1, 1])).num_pages == 0
    assert set(old.tolist()) <= set(np.flatnonzero(cache.pool.ref_counts == 0).tolist())
    assert cache.evict(100) == 2  # only `new` is left to evict
    assert cache.match_prefix(np.array([2, 2, 2, 2])).pages.tolist() == kept.tolist()
    assert cache.match_prefix(np.array([3, 3])).num_pages == 0
    assert set(new.tolist()) <= set(np.flatnonzero(cache.pool.ref_counts == 0).tolist())
    cache.check_integrity([match.pages])
    cache.unlock(match.node)
    cache.pool.release(match.pages)
    assert cache.evict(100) == 2 and cache.pool.num_free == cache.pool.num_pages
    cache.check_integrity([])


def test_eviction_frees_a_parent_once_its_children_are_gone():
    cache = make_cache()
    compute(cache, [1, 2, 3, 4])
    compute(cache, [1, 2, 5, 6])
    assert cache.evict(3) == 3
    assert cache.num_pages == 0 and cache.pool.num_free == cache.pool.num_pages


def test_salts_do_not_share():
    cache = make_cache()
    compute(cache, [1, 2, 3, 4], salt="a")
    assert cache.match_prefix(np.array([1, 2, 3, 4]), salt="b").num_pages == 0
    assert cache.match_prefix(np.array([1, 2, 3, 4])).num_pages == 0
    assert cache.match_prefix(np.array([1, 2, 3, 4]), salt="a").num_pages == 2
    cache.check_integrity([])


# --- random operation sequences ------------------------------------------------------------------

sequences = st.lists(st.integers(0, 2), min_size=0, max_size=10)
operations = st.lists(
    st.one_of(
        st.tuples(st.just("compute"), sequences, st.sampled_from([None, "s"])),
        st.tuples(st.just("use"), sequences, st.sampled_from([None, "s"])),
        st.tuples(st.just("finish"), st.integers(0, 100)),
        st.tuples(st.just("evict"), st.integers(0, 8)),
    ),
    max_size=40,
)


class NaiveCache:
    """Each cached page-prefix (salt, first k pages of tokens) maps to the page holding its k-th page."""

    def __init__(self):
        self.pages: dict[tuple, int] = {}

    def prefixes(self, tokens, salt):
        return [(salt, tuple(tokens[: k * PAGE])) for k in range(1, len(tokens) // PAGE + 1)]

    def match(self, tokens, salt) -> list[int]:
        out = []
        for key in self.prefixes(tokens, salt):
            if key not in self.pages:
                break
            out.append(self.pages[key])
        return out

    def insert(self, tokens, pages, salt):
        for key, page in zip(self.prefixes(tokens, salt), pages, strict=False):
            self.pages.setdefault(key, int(page))


@settings(max_examples=300, deadline=None)
@given(operations)
def test_random_operations_keep_every_invariant_and_agree_with_a_naive_cache(ops):
    cache, naive = make_cache(48), NaiveCache()
    users = []  # (node, pages) of requests holding a locked cached prefix
    for op in ops:
        if op[0] == "compute":
            _, tokens, salt = op
            if len(tokens) // PAGE > cache.pool.num_free:
                cache.evict(len(tokens) // PAGE - cache.pool.num_free)
                naive.pages = {k: p for k, p in naive.pages.items() if cache.pool.ref_counts[p] > 0}
            if len(tokens) // PAGE > cache.pool.num_free:
                continue  # everything left is locked
            pages = compute(cache, tokens, salt)
            naive.insert(tokens, pages, salt)
        elif op[0] == "use":
            _, tokens, salt = op
            before = dump(cache)
            assert cache.peek_prefix(np.array(tokens, np.int32), salt) == len(naive.match(tokens, salt))
            assert dump(cache) == before
            match = cache.match_prefix(np.array(tokens, np.int32), salt)
            assert match.pages.tolist() == naive.match(tokens, salt)
            cache.lock(match.node)
            cache.pool.share(match.pages)
            users.append((match.node, match.pages))
        elif op[0] == "finish" and users:
            node, pages = users.pop(op[1] % len(users))
            cache.unlock(node)
            cache.pool.release(pages)
        elif op[0] == "evict":
            locked = {p for _, pages in users for p in pages.tolist()}
            evictable = cache.evictable_pages
            released = cache.evict(op[1])
            assert released >= min(op[1], evictable)
            assert all(cache.pool.ref_counts[p] > 0 for p in locked)
            naive.pages = {k: p for k, p in naive.pages.items() if cache.pool.ref_counts[p] > 0}
        cache.check_integrity([pages for _, pages in users])
    for tokens in ([0] * 10, [1] * 10, [0, 1, 2] * 3):
        for salt in (None, "s"):
            assert cache.match_prefix(np.array(tokens, np.int32), salt).pages.tolist() == naive.match(tokens, salt)
