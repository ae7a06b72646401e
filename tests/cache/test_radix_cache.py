import random
from dataclasses import dataclass

import numpy as np
import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from shared.cache.allocator import SlotAllocator
from shared.cache.no_cache import NoPrefixCache
from shared.cache.radix_cache import RadixCache


def make(num_pages=64, page_size=1):
    alloc = SlotAllocator(num_pages, page_size, "cpu")
    return alloc, RadixCache(alloc, page_size)


def put(alloc, cache, tokens, namespace=None):
    """Allocate slots for tokens, insert them, free the duplicates; returns the slots used."""
    slots = alloc.alloc(len(tokens))
    done = cache.insert(tokens, slots, namespace)
    alloc.free(slots[:done])
    return slots


def edges(cache, namespace=None):
    """{path of edge keys as tuples} from the namespace root, for structural checks."""
    out = set()

    def walk(node, prefix):
        for child in node.children.values():
            path = prefix + (tuple(child.key.tolist()),)
            out.add(path)
            walk(child, path)

    walk(cache.roots()[namespace], ())
    return out


# ---- unit tests: page_size 1 ----------------------------------------------------------------------

def test_insert_match_and_split():
    alloc, cache = make()
    s1 = put(alloc, cache, [1, 2, 3, 4, 5])
    assert cache.stats()["nodes"] == 1
    s2 = alloc.alloc(4)
    assert cache.insert([1, 2, 9, 9], s2) == 2  # shares [1, 2]
    alloc.free(s2[:2])
    assert edges(cache) == {((1, 2),), ((1, 2), (3, 4, 5)), ((1, 2), (9, 9))}
    r = cache.match_prefix([1, 2, 9, 9, 7])
    assert r.length == 4 and r.slots.tolist() == s1[:2].tolist() + s2[2:].tolist()
    assert cache.stats()["cached_tokens"] == 7 and alloc.available_size() == 64 - 7


def test_match_splits_at_partial_edge_and_returns_boundary_node():
    alloc, cache = make()
    s = put(alloc, cache, [1, 2, 3, 4, 5, 6])
    r = cache.match_prefix([1, 2, 3, 7])
    assert r.slots.tolist() == s[:3].tolist()
    assert edges(cache) == {((1, 2, 3),), ((1, 2, 3), (4, 5, 6))}
    cache.lock(r.node)  # protects exactly the matched 3 tokens
    assert cache.protected_size() == 3 and cache.evictable_size() == 3
    assert cache.evict(100) == 3
    assert cache.match_prefix([1, 2, 3, 4]).length == 3
    cache.unlock(r.node)
    assert cache.evictable_size() == 3 and cache.protected_size() == 0


def test_match_counts_query_and_hit_tokens():
    alloc, cache = make()
    put(alloc, cache, [5, 6, 7])
    cache.match_prefix([5, 6, 8, 8])
    cache.match_prefix([9])
    cache.match_prefix([])
    st_ = cache.stats()
    assert st_["query_tokens"] == 5 and st_["hit_tokens"] == 2


def test_empty_match_returns_lock_inert_root():
    alloc, cache = make()
    r = cache.match_prefix([1, 2])
    assert r.length == 0 and r.slots.dtype == torch.int64
    cache.lock(r.node)
    cache.unlock(r.node)
    assert cache.protected_size() == 0


def test_accepts_tensor_and_numpy_keys():
    alloc, cache = make()
    put(alloc, cache, torch.tensor([3, 4, 5]))
    assert cache.match_prefix(np.array([3, 4, 6])).length == 2


def test_insert_returns_cached_prefix_and_extends():
    alloc, cache = make()
    put(alloc, cache, [1, 2, 3])
    s = alloc.alloc(5)
    assert cache.insert([1, 2, 3, 4, 5], s) == 3
    alloc.free(s[:3])
    assert cache.stats()["cached_tokens"] == 5
    assert alloc.available_size() == 64 - 5
    assert cache.insert([1, 2, 3], s[:3]) == 3  # fully cached: the tree takes nothing


def test_lock_protects_from_eviction_and_counts_sizes():
    alloc, cache = make()
    put(alloc, cache, [1, 2, 3, 4])
    put(alloc, cache, [1, 2, 7, 8, 9])
    r = cache.match_prefix([1, 2, 3, 4])
    cache.lock(r.node)
    cache.lock(r.node)  # two requests share it
    assert cache.protected_size() == 4 and cache.evictable_size() == 3
    assert cache.evict(100) == 3  # only [7, 8, 9] can go; [1, 2] is protected too
    assert cache.evictable_size() == 0
    cache.unlock(r.node)
    assert cache.evict(100) == 0
    cache.unlock(r.node)
    assert cache.evictable_size() == 4
    assert cache.evict(1) == 2  # leaf [3, 4] first; evict frees whole edges
    assert cache.evict(100) == 2  # then its parent became a leaf
    assert alloc.available_size() == 64 and cache.stats()["evicted_tokens"] == 7
    put(alloc, cache, [5, 5])
    with pytest.raises(AssertionError):
        cache.unlock(cache.match_prefix([5, 5]).node)  # never locked
    with pytest.raises(AssertionError):
        cache.lock(r.node)  # evicted handle


def test_lru_order():
    alloc, cache = make()
    put(alloc, cache, [1, 1])
    put(alloc, cache, [2, 2])
    put(alloc, cache, [3, 3])
    cache.match_prefix([1, 1])  # now [2, 2] is the least recently used
    assert cache.evict(1) == 2
    assert cache.match_prefix([2, 2]).length == 0
    assert cache.match_prefix([1, 1]).length == 2
    assert cache.evict(1) == 2
    assert cache.match_prefix([3, 3]).length == 0  # [3, 3] was older than the fresh touch of [1, 1]
    assert cache.match_prefix([1, 1]).length == 2


def test_parent_becomes_evictable_leaf_in_lru_position():
    alloc, cache = make()
    put(alloc, cache, [1, 2, 3])
    put(alloc, cache, [1, 2, 4])  # splits: [1, 2] -> {[3], [4]}
    put(alloc, cache, [9, 9, 9, 9])
    cache.match_prefix([9, 9, 9, 9])
    # Leaves [3], [4] are the oldest; then their parent [1, 2] (touched with them) before [9, 9, 9, 9].
    assert cache.evict(4) == 4
    assert cache.match_prefix([9, 9, 9, 9]).length == 4
    assert cache.stats()["cached_tokens"] == 4


def test_namespaces_isolate():
    alloc, cache = make()
    put(alloc, cache, [1, 2, 3], namespace="tenant-a")
    assert cache.match_prefix([1, 2, 3]).length == 0
    assert cache.match_prefix([1, 2, 3], namespace="tenant-b").length == 0
    assert cache.match_prefix([1, 2, 3], namespace="tenant-a").length == 3
    s = put(alloc, cache, [1, 2, 3])  # same tokens, default namespace: its own copy
    assert cache.match_prefix([1, 2, 3]).slots.tolist() == s.tolist()
    assert cache.stats()["cached_tokens"] == 6
    assert cache.evict(100) == 6
    assert set(cache.roots()) == {None}  # emptied tenant roots are dropped


def test_reset_frees_everything_and_refuses_while_locked():
    alloc, cache = make()
    put(alloc, cache, [1, 2, 3])
    put(alloc, cache, [4, 5], namespace="x")
    r = cache.match_prefix([1, 2])
    cache.lock(r.node)
    with pytest.raises(AssertionError):
        cache.reset()
    cache.unlock(r.node)
    cache.reset()
    assert alloc.available_size() == 64
    assert cache.stats()["cached_tokens"] == 0 and cache.stats()["nodes"] == 0
    assert cache.match_prefix([1, 2, 3]).length == 0
    put(alloc, cache, [1, 2, 3])
    assert cache.match_prefix([1, 2, 3]).length == 3


def test_heap_does_not_grow_with_repeated_touches():
    alloc, cache = make()
    for i in range(10):
        put(alloc, cache, [i, i])
    for _ in range(5000):
        cache.match_prefix([3, 3])
    assert len(cache._heap) <= 2 * cache.stats()["nodes"] + 1024 + 1


# ---- unit tests: page_size 4 ----------------------------------------------------------------------

def test_page_aligned_match_and_insert():
    alloc, cache = make(num_pages=16, page_size=4)
    s = put(alloc, cache, list(range(12)))
    r = cache.match_prefix(list(range(11)))  # only 2 full pages can match
    assert r.length == 8 and r.slots.tolist() == s[:8].tolist()
    r = cache.match_prefix(list(range(6)) + [99, 99, 99, 99])  # mismatch inside page 2
    assert r.length == 4
    a, b, c = tuple(range(4)), tuple(range(4, 8)), tuple(range(8, 12))  # both matches split an edge
    assert edges(cache) == {(a,), (a, b), (a, b, c)}
    assert cache.match_prefix([0, 1, 2]).length == 0
    with pytest.raises(AssertionError):
        cache.insert([1, 2, 3], alloc.alloc(3))


def test_children_keyed_by_first_page():
    alloc, cache = make(num_pages=16, page_size=4)
    put(alloc, cache, [1, 2, 3, 4, 5, 6, 7, 8])
    s = alloc.alloc(8)
    # Same first token, different first page: a sibling, not a split.
    assert cache.insert([1, 2, 3, 9, 5, 6, 7, 8], s) == 0
    assert cache.stats()["nodes"] == 2
    assert cache.match_prefix([1, 2, 3, 9, 5, 6, 7, 8]).slots.tolist() == s.tolist()


def test_page_size_4_eviction_frees_pages():
    alloc, cache = make(num_pages=8, page_size=4)
    put(alloc, cache, list(range(8)))
    put(alloc, cache, list(range(4)) + [50, 51, 52, 53])
    assert alloc.available_size() == 32 - 12
    assert cache.evict(4) == 4
    assert cache.evict(100) == 8 and alloc.available_size() == 32


# ---- no-cache ablation ----------------------------------------------------------------------------

def test_no_prefix_cache_drops_everything():
    alloc = SlotAllocator(8, 4)
    cache = NoPrefixCache(alloc, 4)
    slots = alloc.alloc(8)
    assert cache.match_prefix([1, 2, 3, 4]).length == 0
    assert cache.insert(list(range(8)), slots) == 0
    assert alloc.available_size() == 32  # the cache owned the slots and dropped them
    r = cache.match_prefix(list(range(8)))
    cache.lock(r.node)
    cache.unlock(r.node)
    assert cache.evict(10) == 0 and cache.evictable_size() == 0 and cache.protected_size() == 0
    assert cache.stats()["hit_tokens"] == 0 and cache.stats()["query_tokens"] == 12


# ---- property tests: a scheduler-like workload with a full invariant check after every step -------

@dataclass
class Req:
    ns: str | None
    tokens: list[int]
    node: object
    prefix_len: int  # tokens served by the tree (locked)
    slots: list[int]  # every token's slot, in position order; [prefix_len:] are the request's own


class Workload:
    def __init__(self, page_size: int, num_pages: int):
        self.ps = page_size
        self.alloc = SlotAllocator(num_pages, page_size, "cpu")
        self.cache = RadixCache(self.alloc, page_size)
        self.reqs: list[Req] = []
        self.history: list[tuple[list[int], str | None]] = [([], None)]  # earlier prompts to share from
        # The KV a slot holds, named by what it was computed for: (namespace, token prefix).
        self.content: dict[int, tuple] = {}

    # -- the request life ---------------------------------------------------------------------------
    def _alloc(self, n: int, last_slot: int = -1):
        got = self.alloc.alloc(n, last_slot)
        if got is None:
            self.cache.evict(n - self.alloc.available_size() + self.ps)
            got = self.alloc.alloc(n, last_slot)
        return got

    def start(self, base: int, cut: int, tail: list[int], ns: str | None):
        """A new request: a prefix of an earlier prompt plus a tail; ns "same" reuses that prompt's."""
        prev, prev_ns = self.history[base % len(self.history)]
        ns = prev_ns if ns == "same" else ns
        tokens = prev[:cut % (len(prev) + 1)] + tail
        if not tokens:
            return
        self.history.append((tokens, ns))
        expected = self.reference_match(tokens, ns)
        r = self.cache.match_prefix(tokens, ns)
        m = r.length
        assert m == expected
        for i, s in enumerate(r.slots.tolist()):
            assert self.content[s] == (ns, tuple(tokens[:i + 1])), "matched a slot holding other KV"
        self.cache.lock(r.node)
        own = self._alloc(len(tokens) - m)
        if own is None:
            self.cache.unlock(r.node)
            return
        for i, s in enumerate(own.tolist()):
            self.content[s] = (ns, tuple(tokens[:m + i + 1]))
        self.reqs.append(Req(ns, tokens, r.node, m, r.slots.tolist() + own.tolist()))

    def extend(self, idx: int, tail: list[int]):
        if not self.reqs or not tail:
            return
        req = self.reqs[idx % len(self.reqs)]
        last = req.slots[-1]
        more = self._alloc(len(tail), last)
        if more is None:
            return
        more = more.tolist()
        if (last + 1) % self.ps:
            assert more[0] == last + 1, "did not continue the request's own page"
        req.tokens = req.tokens + tail
        for i, s in enumerate(more):
            self.content[s] = (req.ns, tuple(req.tokens[:len(req.slots) + i + 1]))
        req.slots += more

    def finish(self, idx: int):
        if not self.reqs:
            return
        req = self.reqs.pop(idx % len(self.reqs))
        aligned = len(req.tokens) - len(req.tokens) % self.ps
        slots = torch.tensor(req.slots, dtype=torch.int64)
        done = self.cache.insert(req.tokens[:aligned], slots[:aligned], req.ns)
        assert done >= req.prefix_len, "the locked prefix vanished from the tree"
        self.alloc.free(slots[req.prefix_len:done])  # duplicates of what the tree already had
        self.alloc.free(slots[aligned:])  # the partial last page is never cached
        self.cache.unlock(req.node)

    def abort(self, idx: int):
        if not self.reqs:
            return
        req = self.reqs.pop(idx % len(self.reqs))
        self.alloc.free(torch.tensor(req.slots[req.prefix_len:], dtype=torch.int64))
        self.cache.unlock(req.node)

    def evict(self, n: int):
        before = self.cache.evictable_size()
        freed = self.cache.evict(n)
        assert freed >= min(n, before) or freed == before
        assert self.cache.evictable_size() == before - freed

    def flush(self):
        if not self.reqs:
            self.cache.reset()
            assert self.alloc.available_size() == self.alloc.total_size()

    def drain(self):
        """Finish everything, evict everything: the pool must be whole again."""
        while self.reqs:
            self.finish(0)
            self.check()
        self.cache.evict(10**9)
        self.check()
        assert self.cache.stats()["cached_tokens"] == 0
        assert self.alloc.available_size() == self.alloc.total_size()

    # -- reference model and invariants -------------------------------------------------------------
    def tree_paths(self):
        """(namespace, node, token path to the node's end) for every node, by walking the tree."""
        out = []
        for ns, root in self.cache.roots().items():
            stack = [(root, ())]
            while stack:
                node, path = stack.pop()
                for child in node.children.values():
                    p = path + tuple(child.key.tolist())
                    out.append((ns, child, p))
                    stack.append((child, p))
        return out

    def reference_match(self, tokens, ns) -> int:
        cached = set()
        for node_ns, node, path in self.tree_paths():
            if node_ns == ns:
                for k in range(len(path) - len(node.key) + self.ps, len(path) + 1, self.ps):
                    cached.add(path[:k])
        best = 0
        for k in range(self.ps, len(tokens) + 1, self.ps):
            if tuple(tokens[:k]) in cached:
                best = k
        return best

    def check(self):
        ps, cache, alloc = self.ps, self.cache, self.alloc
        paths = self.tree_paths()
        evictable = protected = 0
        tree_pages = []
        expected_refs: dict[int, int] = {}
        for req in self.reqs:
            node = req.node
            while node.parent is not None:
                expected_refs[id(node)] = expected_refs.get(id(node), 0) + 1
                node = node.parent
        for ns, node, path in paths:
            n = len(node.key)
            assert n > 0 and n % ps == 0 and len(node.value) == n
            assert node.parent.children[cache._child_key(node.key)] is node
            assert node.lock_ref == expected_refs.get(id(node), 0), "lock refs out of step"
            if node.lock_ref:
                protected += n
            else:
                evictable += n
            pages = node.value.reshape(-1, ps)
            assert (pages == pages[:, :1] + np.arange(ps)).all() and (pages[:, 0] % ps == 0).all()
            tree_pages += (pages[:, 0] // ps).tolist()
            for i, s in enumerate(node.value.tolist()):  # every cached slot holds its own prefix's KV
                assert self.content[s] == (ns, path[:len(path) - n + i + 1])
        assert cache.evictable_size() == evictable and cache.protected_size() == protected
        st_ = cache.stats()
        assert st_["cached_tokens"] == evictable + protected and st_["nodes"] == len(paths)
        inflight_pages = [p for req in self.reqs for p in sorted({s // ps for s in req.slots[req.prefix_len:]})]
        inflight = len(inflight_pages) * ps
        assert alloc.available_size() + evictable + protected + inflight == alloc.total_size()
        owned = tree_pages + inflight_pages + alloc.free_pages().tolist()
        assert sorted(owned) == list(range(1, alloc.num_pages + 1)), "a page is owned twice or leaked"
        # Every evictable leaf must be reachable through a live heap entry, or evict() would miss it.
        live = {id(e[2]) for e in cache._heap if e[0] == e[2].last_access}
        for _, node, _ in paths:
            if not node.children and node.lock_ref == 0:
                assert id(node) in live
        for ns, root in cache.roots().items():
            assert ns is None or root.children, "empty tenant root kept"

    def apply(self, op):
        kind, *args = op
        getattr(self, kind)(*args)
        self.check()


ALPHABET = 3  # few distinct tokens: many shared prefixes, splits and page-internal mismatches
tokens_st = st.lists(st.integers(0, ALPHABET - 1), max_size=14)
ns_st = st.sampled_from([None, "t1", "same", "same"])
op_st = st.one_of(
    st.tuples(st.just("start"), st.integers(0, 50), st.integers(0, 40), tokens_st, ns_st),
    st.tuples(st.just("start"), st.integers(0, 50), st.integers(0, 40), tokens_st, ns_st),
    st.tuples(st.just("extend"), st.integers(0, 9), st.lists(st.integers(0, ALPHABET - 1), min_size=1, max_size=6)),
    st.tuples(st.just("finish"), st.integers(0, 9)),
    st.tuples(st.just("abort"), st.integers(0, 9)),
    st.tuples(st.just("evict"), st.integers(0, 20)),
    st.tuples(st.just("flush")),
)


@pytest.mark.parametrize("page_size,num_pages", [(1, 24), (4, 10)])
def test_property_random_workloads(page_size, num_pages):
    @settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow])
    @given(st.lists(op_st, max_size=40))
    def run(ops):
        w = Workload(page_size, num_pages)
        for op in ops:
            w.apply(op)
        w.drain()

    run()


@pytest.mark.parametrize("page_size,num_pages", [(1, 120), (4, 40)])
def test_seeded_long_workload(page_size, num_pages):
    rng = random.Random(7 * page_size)
    w = Workload(page_size, num_pages)

    def toks(k):
        return [rng.randrange(ALPHABET) for _ in range(k)]

    for step in range(1500):
        x = rng.random()
        if x < 0.35 and len(w.reqs) < 12:
            w.apply(("start", rng.randrange(10**6), rng.randrange(30), toks(rng.randrange(10)),
                     rng.choice([None, "t1", "t2", "same", "same", "same"])))
        elif x < 0.5:
            w.apply(("extend", rng.randrange(10), toks(rng.randint(1, 5))))
        elif x < 0.8:
            w.apply(("finish", rng.randrange(10)))
        elif x < 0.85:
            w.apply(("abort", rng.randrange(10)))
        elif x < 0.99:
            w.apply(("evict", rng.randrange(8)))
        else:
            w.apply(("flush",))
        if len(w.history) > 200:
            w.history = w.history[-100:]
    w.drain()
    st_ = w.cache.stats()  # the workload really exercised sharing and eviction
    assert st_["hit_tokens"] > 0.1 * st_["query_tokens"] and st_["evicted_tokens"] > 1000


# ---- incremental match lengths (LPM on long queues) ------------------------------------------------
@pytest.mark.parametrize("page_size", [1, 4])
def test_memoized_match_length_equals_a_full_rematch_under_random_tree_changes(page_size):
    rng = random.Random(11 + page_size)
    alloc, cache = make(num_pages=400, page_size=page_size)
    heads = [[rng.randrange(1, 6) for _ in range(rng.randrange(4, 24))] for _ in range(6)]

    def prompt():
        return rng.choice(heads)[:rng.randrange(0, 24)] + [rng.randrange(1, 6) for _ in range(rng.randrange(1, 16))]

    queue = [(prompt(), rng.choice([None, None, "s"])) for _ in range(40)]
    memos = [None] * len(queue)
    locked = []
    walks = 0
    for it in range(250):
        op = rng.random()
        if op < 0.35:
            key, ns = prompt(), rng.choice([None, "s", "t"])
            n = len(key) - len(key) % page_size
            if n and alloc.available_size() >= n:
                put(alloc, cache, key[:n], ns)
        elif op < 0.5:
            cache.evict(rng.randrange(1, 30))
        elif op < 0.6:
            key, ns = rng.choice(queue)
            m = cache.match_prefix(key, ns)  # splits edges, may lock
            if m.length and rng.random() < 0.5:
                cache.lock(m.node)
                locked.append(m.node)
        elif op < 0.65 and locked:
            cache.unlock(locked.pop(rng.randrange(len(locked))))
        elif op < 0.67 and not locked:
            cache.reset()
        for i, (key, ns) in enumerate(queue):
            before = memos[i]
            got, memos[i] = cache.match_length(key, ns, memos[i])
            walks += memos[i] is not before
            want = cache.match_prefix(key, ns, record=False).length
            assert got == want, (it, i, got, want)
    assert walks < 0.6 * 250 * len(queue)  # most answers came from the memo


def test_match_length_touches_nothing_and_counts_nothing():
    alloc, cache = make()
    put(alloc, cache, [1, 2, 3, 4, 5])
    before = (cache.stats(), edges(cache))
    length, memo = cache.match_length([1, 2, 3, 9], None, None)
    assert length == 3 and (cache.stats(), edges(cache)) == before
    assert cache.match_length([1, 2, 3, 9], None, memo) == (3, memo)
    put(alloc, cache, [1, 2, 3, 9, 9])  # a child under the matched path's end: re-walked
    assert cache.match_length([1, 2, 3, 9], None, memo)[0] == 4


def test_shared_prefix_groups_are_the_deepest_node_of_each_shared_set():
    """Random trees and batches: every set of >= 2 requests sharing a node is reported once, at the
    deepest node with exactly that set (a brute force over every path says which)."""
    rng = random.Random(7)
    for trial in range(30):
        alloc, cache = make(num_pages=4096)
        keys = []
        for _ in range(rng.randrange(2, 12)):
            base = rng.choice(keys) if keys and rng.random() < 0.7 else []
            key = base[:rng.randrange(0, len(base) + 1)] + [rng.randrange(1, 6) for _ in range(rng.randrange(1, 6))]
            put(alloc, cache, key)
            keys.append(key)
        nodes = [cache.match_prefix(k).node for k in rng.sample(keys, rng.randrange(1, len(keys) + 1))]
        want: dict[frozenset, int] = {}
        sets: dict[int, tuple[int, set]] = {}
        for i, n in enumerate(nodes):
            d = sum(len(m.key) for m in _path(n))
            for m in _path(n):
                sets.setdefault(id(m), (d, set()))[1].add(i)
                d -= len(m.key)
        for d, members in sets.values():
            if len(members) >= 2:
                want[frozenset(members)] = max(d, want.get(frozenset(members), 0))
        got = cache.shared_prefix_groups(nodes)
        assert all(m == sorted(m) for _, m in got)
        assert {frozenset(m): d for d, m in got} == want and len(got) == len(want), trial


def test_shared_prefix_groups_are_kept_for_the_same_nodes_only():
    """The answer for one decode batch is reused while its nodes are the same objects: a split above
    them (an insert diverging inside a shared edge) leaves it right, and another node list recomputes."""
    alloc, cache = make(num_pages=256)
    system = list(range(1, 41))
    nodes = []
    for q in ([100, 1], [100, 2], [200]):
        put(alloc, cache, system + q)
        nodes.append(cache.match_prefix(system + q).node)
    first = cache.shared_prefix_groups(nodes)
    assert sorted(first) == [(40, [0, 1, 2]), (41, [0, 1])]
    assert cache.shared_prefix_groups(list(nodes)) is first  # the same nodes, a new list: kept
    put(alloc, cache, system[:20] + [999])  # splits the shared edge at 20
    again = cache.shared_prefix_groups(nodes)
    assert sorted(again) == sorted(first) == sorted(cache._shared_prefix_groups(tuple(nodes)))
    other = nodes[:2] + [cache.match_prefix(system[:20] + [999]).node]
    assert sorted(cache.shared_prefix_groups(other)) == [(20, [0, 1, 2]), (41, [0, 1])]


def _path(node):
    out = []
    while node is not None and node.parent is not None:
        out.append(node)
        node = node.parent
    return out


def test_shared_prefix_groups_nest_every_node_shared_in_the_batch():
    alloc, cache = make(num_pages=256)
    system = list(range(1, 41))
    nodes = []
    for q in ([100, 1, 2], [100, 1, 3], [200, 5], [200, 6], [300]):
        put(alloc, cache, system + q)
        nodes.append(cache.match_prefix(system + q).node)
    other = put(alloc, cache, [7, 7, 7]) is not None and cache.match_prefix([7, 7, 7]).node
    groups = cache.shared_prefix_groups(nodes + [other, None, cache.roots()[None]])
    assert sorted(groups) == [(40, [0, 1, 2, 3, 4]), (41, [2, 3]), (42, [0, 1])]
    assert cache.shared_prefix_groups(nodes[4:] + nodes[2:3]) == [(40, [0, 1])]
    assert NoPrefixCache(alloc, 1).shared_prefix_groups(nodes) == []


# ---- a running request's KV growing in the tree (insert_extending) ---------------------------------

def _tree_state(cache):
    """Every node's path, slots and lock count, and the size counters: what the two ways must agree on."""
    out = {}

    def walk(node, path):
        for child in node.children.values():
            p = path + tuple(child.key.tolist())
            out[p] = (tuple(child.value.tolist()), child.lock_ref)
            walk(child, p)

    for ns, root in cache.roots().items():
        walk(root, (ns,))
    return out, cache.evictable_size(), cache.protected_size(), cache.stats()["nodes"]


@pytest.mark.parametrize("page_size", [1, 4])
@pytest.mark.parametrize("seed", range(6))
def test_insert_extending_from_the_request_node_equals_insert_from_the_root(page_size, seed):
    """Requests grow their KV chunk by chunk (catch-up passes of jump-forward), sharing prefixes, some
    computing tokens another put into the tree first, and end (released as the scheduler does): the
    walk from the request's locked node leaves the same tree, locks, sizes and slots as the generic
    insert from the root + re-match + lock move (PrefixCache.insert_extending)."""
    from shared.cache.base import PrefixCache

    rng = random.Random(seed)
    runs = []
    for fast in (True, False):
        rng = random.Random(seed)
        alloc, cache = make(num_pages=4096, page_size=page_size)
        extend = cache.insert_extending if fast else (
            lambda *a, **k: PrefixCache.insert_extending(cache, *a, **k))
        live = []  # [tokens, slots, node, cached, namespace]
        log = []
        for _ in range(120):
            op = rng.random()
            if op < 0.25 or not live:
                ns = rng.choice([None, None, "t"])
                base = rng.choice([[1], [1, 2, 3, 4] * page_size, [5] * (2 * page_size) + [6]])
                m = cache.match_prefix(base, namespace=ns)
                cache.lock(m.node)
                slots = m.slots.tolist() + alloc.alloc(len(base) - m.length).tolist()
                live.append([list(base), slots, m.node, m.length, ns])
            elif op < 0.85:
                r = rng.choice(live)
                grow = rng.randint(1, 3) * page_size
                r[0].extend(rng.choice([1, 2, 3]) for _ in range(grow))
                r[1].extend(alloc.alloc(grow, r[1][-1]).tolist())
                n = len(r[0]) - len(r[0]) % page_size
                if n <= r[3]:
                    continue
                returned, node, tree = extend(r[2], r[3], r[0][:n], r[1][:n], namespace=r[4])
                if returned > r[3]:
                    alloc.free(np.asarray(r[1][r[3]:returned]))
                    r[1][r[3]:returned] = tree.tolist()
                r[2], r[3] = node, n
                log.append((returned, tuple(r[1][:n])))
            else:
                r = live.pop(rng.randrange(len(live)))
                aligned = len(r[0]) - len(r[0]) % page_size
                slots = torch.tensor(r[1], dtype=torch.int64)
                done = cache.insert(r[0][:aligned], slots[:aligned], namespace=r[4]) if aligned else 0
                if done > r[3]:
                    alloc.free(slots[r[3]:done])
                if len(slots) > aligned:
                    alloc.free(slots[aligned:])
                cache.unlock(r[2])
        runs.append((_tree_state(cache), log, alloc.available_size()))
    assert runs[0] == runs[1]



class _Requests:
    """Random requests on one tree, driven as the scheduler drives it: admitted on their cached prefix
    (locked), growing in catch-up passes (insert_extending), ending (their KV inserted from the root, or
    with insert_from, then unlocked), and evictions in between. live: [tokens, slots, node, cached, ns]."""

    def __init__(self, page_size: int, seed: int, namespaces=(None,)):
        self.rng, self.ps, self.namespaces = random.Random(seed), page_size, namespaces
        self.alloc, self.cache = make(num_pages=4096, page_size=page_size)
        self.live: list[list] = []

    def admit(self) -> None:
        ps = self.ps
        ns = self.rng.choice(self.namespaces)
        base = self.rng.choice([[1], [1, 2, 3, 4] * ps, [5] * (2 * ps) + [6]])
        m = self.cache.match_prefix(base, namespace=ns)
        self.cache.lock(m.node)
        slots = m.slots.tolist() + self.alloc.alloc(len(base) - m.length).tolist()
        self.live.append([list(base), slots, m.node, m.length, ns])

    def grow(self, insert: bool = True) -> None:
        r = self.rng.choice(self.live)
        grow = self.rng.randint(1, 3) * self.ps
        r[0].extend(self.rng.choice([1, 2, 3]) for _ in range(grow))
        r[1].extend(self.alloc.alloc(grow, r[1][-1]).tolist())
        n = len(r[0]) - len(r[0]) % self.ps
        if n > r[3] and insert:
            returned, node, tree = self.cache.insert_extending(r[2], r[3], r[0][:n], r[1][:n], namespace=r[4])
            if returned > r[3]:
                self.alloc.free(np.asarray(r[1][r[3]:returned]))
                r[1][r[3]:returned] = tree.tolist()
            r[2], r[3] = node, n

    def end(self, from_node: bool = False) -> int:
        r = self.live.pop(self.rng.randrange(len(self.live)))
        aligned = len(r[0]) - len(r[0]) % self.ps
        slots = torch.tensor(r[1], dtype=torch.int64)
        if from_node:
            done = self.cache.insert_from(r[2], r[3], r[0][:aligned], r[1][:aligned], namespace=r[4])
        else:
            done = self.cache.insert(r[0][:aligned], slots[:aligned], namespace=r[4]) if aligned else 0
        if done > r[3]:
            self.alloc.free(slots[r[3]:done])
        if len(slots) > aligned:
            self.alloc.free(slots[aligned:])
        self.cache.unlock(r[2])
        return done

    def step(self, from_node: bool = False):
        """One random operation; what it returned (ends and evictions), else None."""
        op = self.rng.random()
        if op < 0.3 or not self.live:
            self.admit()
        elif op < 0.75:
            self.grow(insert=self.rng.random() < 0.7)  # some grow past their inserted part before they end
        elif op < 0.95:
            return self.end(from_node)
        else:
            return self.cache.evict(self.rng.randint(1, 3 * self.ps))
        return None


@pytest.mark.parametrize("page_size", [1, 4])
@pytest.mark.parametrize("seed", range(6))
def test_private_leaf_is_a_leaf_no_other_lock_ends_on_or_above(page_size, seed):
    """is_private_leaf (what lets the engine insert a pass's KV ahead of the next schedule) against the
    definition, and every node's lock count = locks ending on it + its children's, along requests that
    share prefixes, grow (insert_extending, with splits), end (insert from the root, unlock) and evict."""
    reqs = _Requests(page_size, seed)
    cache = reqs.cache
    checked = private = 0
    for _ in range(150):
        reqs.step()
        ends: dict[int, int] = {}
        for r in reqs.live:
            ends[id(r[2])] = ends.get(id(r[2]), 0) + 1
        for node in cache.nodes():
            assert node.lock_ends == ends.get(id(node), 0)
            assert node.lock_ref == node.lock_ends + sum(c.lock_ref for c in node.children.values())
        for r in reqs.live:
            node, want = r[2], False
            if node.parent is not None and not node.children and ends[id(node)] == 1:
                up, want = node.parent, True
                while up.parent is not None:
                    want = want and not ends.get(id(up), 0)
                    up = up.parent
            assert cache.is_private_leaf(node) == want
            checked += 1
            private += want
    assert checked and 0 < private < checked  # both answers came up


@pytest.mark.parametrize("page_size", [1, 4])
@pytest.mark.parametrize("seed", range(6))
def test_a_release_inserting_from_the_request_node_equals_inserting_from_the_root(page_size, seed):
    """insert_from (a request's KV entering the tree when it ends, from its own node) against insert from
    the root: the same tree, locks, sizes, LRU times, returned lengths and eviction order, for requests
    sharing prefixes, growing in catch-up passes, some in a namespace, ending at random."""
    runs = []
    for from_node in (True, False):
        reqs = _Requests(page_size, seed, namespaces=(None, None, "t"))
        log = [reqs.step(from_node) for _ in range(150)]
        cache, alloc = reqs.cache, reqs.alloc
        state, times = _tree_state(cache), _tree_times(cache)
        for r in reqs.live:
            cache.unlock(r[2])
        freed = []
        while cache.evictable_size():
            before = set(alloc.free_pages().tolist())
            cache.evict(1)
            freed.append(sorted(set(alloc.free_pages().tolist()) - before))
        runs.append((state, times, log, freed))
    assert runs[0] == runs[1]


def _tree_times(cache):
    """Every node's path and LRU time."""
    out = {}

    def walk(node, path):
        for child in node.children.values():
            p = path + tuple(child.key.tolist())
            out[p] = child.last_access
            walk(child, p)

    for ns, root in cache.roots().items():
        walk(root, (ns,))
    return out
