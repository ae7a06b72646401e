"""Radix tree over token ids mapping every cached prefix to the pool slots holding its KV.

Edges hold runs of tokens (numpy int32) and their slots (numpy int64, host side: the tree is host
bookkeeping, and only matched prefixes travel to the device). With page_size > 1 every edge is a whole
number of pages and a child is found by its first page, so matches are page-aligned by construction.

Lock references count the running requests whose prefix goes through a node; a node with none is
evictable once it is a leaf. Eviction takes least recently used leaves first through a lazy heap: entries
are pushed whenever a node becomes an evictable leaf or is touched as one, and stale entries are skipped
when popped, so no operation walks the whole tree.

Ordering a long queue by match length (LPM) must not re-walk every queued prompt each round, so every
node carries a version bumped whenever its set of children changes (a leaf added under it, a child
evicted, a child split), and the cache an epoch bumped when a namespace root comes or goes or on reset.
A match stops at its deepest fully matched node N (maybe part way into one child of N); it can only
grow or shrink through a change of N's children or N's eviction, so (N, N.version, epoch) is enough to
know an earlier answer still holds (`match_length`).
"""
from __future__ import annotations

import heapq
from typing import Iterator, Sequence

import numpy as np
import torch

from shared.cache.allocator import SlotAllocator, to_numpy_slots
from shared.cache.base import MatchResult, PrefixCache


class TreeNode:
    __slots__ = ("key", "value", "children", "parent", "lock_ref", "lock_ends", "last_access", "version",
                 "host_value", "host_pending")

    def __init__(self, key: np.ndarray, value: np.ndarray, parent: "TreeNode | None", last_access: int):
        self.key = key  # int32 token ids of this edge
        self.value = value  # int64 pool slots, one per token
        self.children: dict | None = {}  # None once evicted
        self.parent = parent  # None for a root (and for evicted nodes)
        self.lock_ref = 0  # locks whose path goes through this node
        self.lock_ends = 0  # ... of them, those that end here (a request's own node: lock() / insert_extending)
        self.last_access = last_access
        self.version = 0  # bumped when `children` changes (see match_length)
        # The host tier (shared/cache/hiradix_cache.py): host pool slots of a copy of this KV, or None; `value`
        # is None while the KV is on the host only. host_pending: the copy's event until it completes.
        self.host_value: np.ndarray | None = None
        self.host_pending = None

    @property
    def evicted(self) -> bool:
        return self.children is None

    def __repr__(self) -> str:
        return f"TreeNode(len={len(self.key)}, lock_ref={self.lock_ref}, children={len(self.children or ())})"


# insert_extending's answer when the tree held none of the new tokens (read-only: callers only slice it).
_NO_SLOTS = torch.empty(0, dtype=torch.int64)


def as_tokens(key) -> np.ndarray:
    if isinstance(key, torch.Tensor):
        return key.detach().to("cpu", torch.int32).numpy()
    return np.asarray(key, dtype=np.int32)


def _on_device(node: TreeNode) -> bool:
    return node.value is not None  # (a host-tier node may hold its KV on the host only)


def _head(slots: np.ndarray | None, m: int) -> np.ndarray | None:
    return None if slots is None else slots[:m].copy()


def _tail(slots: np.ndarray | None, m: int) -> np.ndarray | None:
    return None if slots is None else slots[m:].copy()


def common_prefix_len(a: np.ndarray, b: np.ndarray) -> int:
    n = min(a.shape[0], b.shape[0])
    eq = a[:n] == b[:n]
    return n if eq.all() else int(eq.argmin())


class RadixCache(PrefixCache):
    def __init__(self, allocator: SlotAllocator, page_size: int):
        assert page_size == allocator.page_size, "tree and allocator must agree on the page size"
        self.allocator = allocator
        self.page_size = page_size
        self.device = allocator.device
        self._clock = 0  # logical time: strictly increasing, so heap entries can be checked exactly
        self._seq = 0  # heap tie-breaker (never compare nodes)
        self._roots: dict[str | None, TreeNode] = {}
        self._root_namespace: dict[int, str] = {}  # id(root) -> its namespace, for non-default roots
        self._heap: list[tuple[int, int, TreeNode]] = []
        self._evictable = 0
        self._protected = 0
        self._num_nodes = 0
        self._hit_tokens = 0
        self._query_tokens = 0
        self._evicted_tokens = 0
        self._epoch = 0  # bumped when a namespace root is created or dropped, and on reset
        self._roots[None] = self._new_root()
        self._groups_memo: tuple[tuple, int, list] | None = None  # (nodes, epoch, groups): shared_prefix_groups

    # ---- PrefixCache -------------------------------------------------------------------------------
    def match_prefix(self, key: Sequence[int], namespace: str | None = None, record: bool = True) -> MatchResult:
        tokens = as_tokens(key)
        if record:
            self._query_tokens += int(tokens.shape[0])
        root = self._roots.get(namespace)
        if root is None:  # an unknown namespace has nothing cached; roots are lock-inert handles
            return MatchResult(self._empty_slots(), self._roots[None])
        aligned = tokens.shape[0] - tokens.shape[0] % self.page_size
        node, matched, values = self._walk(root, tokens[:aligned], self._tick())
        if record:
            self._hit_tokens += matched
        slots = torch.from_numpy(np.concatenate(values)).to(self.device) if values else self._empty_slots()
        return MatchResult(slots, node)

    def match_length(self, key: Sequence[int], namespace: str | None = None, memo=None) -> tuple[int, tuple]:
        """Cached prefix length of key without touching or splitting anything. memo: the previous
        answer's memo for the same key (or None); answered in O(1) while it is still valid."""
        n = len(key)
        aligned = n - n % self.page_size
        if memo is not None:
            node, version, epoch, klen, length = memo
            if epoch == self._epoch and klen == aligned and (
                    node is None or (not node.evicted and node.version == version)):
                return length, memo
        root = self._roots.get(namespace)
        if root is None:  # nothing cached under this namespace; valid until a root comes (epoch)
            memo = (None, 0, self._epoch, aligned, 0)
            return 0, memo
        node, length = self._peek(root, as_tokens(key[:aligned]))
        memo = (node, node.version, self._epoch, aligned, length)
        return length, memo

    def insert(self, key: Sequence[int], slots: torch.Tensor, namespace: str | None = None) -> int:
        tokens = as_tokens(key)
        n = tokens.shape[0]
        assert n == len(slots), f"key has {n} tokens but {len(slots)} slots"
        assert n % self.page_size == 0, f"insert of {n} tokens is not page-aligned"
        if n == 0:
            return 0
        root = self._roots.get(namespace)
        if root is None:
            root = self._roots[namespace] = self._new_root()
            self._root_namespace[id(root)] = namespace
            self._epoch += 1
        now = self._tick()
        node, matched, _ = self._walk(root, tokens, now)
        if matched < n:
            self._add_leaf(node, tokens[matched:], to_numpy_slots(slots)[matched:], now)
        return matched

    def insert_from(self, node: TreeNode, start: int, key: Sequence[int], slots: Sequence[int],
                    namespace: str | None = None) -> int:
        """As insert(), in O(depth + new tokens): the path above `node` is touched as the walk from the
        root touches it, without comparing its tokens again (a request's path is dozens of nodes deep after
        jump-forward's catch-up passes); the new tokens are matched and added below node."""
        if not self._walks_from(node, namespace):
            return super().insert_from(node, start, key, slots, namespace)
        n = len(key)
        assert n == len(slots) and n % self.page_size == 0 and start % self.page_size == 0 and start <= n
        if n == 0:
            return 0
        now = self._tick()
        up = node
        while up.parent is not None:
            up.last_access = now
            up = up.parent
        if start == n:  # the walk from the root ends at node, which the request's lock keeps off the heap
            return n
        _, matched, _ = self._extend_below(node, as_tokens(key[start:]), slots, start, now)
        return start + matched

    def _walks_from(self, node: TreeNode | None, namespace: str | None) -> bool:
        """A request's node its inserts may start from: in the tree, and a node or its namespace's root (a
        request with nothing cached holds that root)."""
        return (node is not None and not node.evicted
                and (node.parent is not None or node is self._roots.get(namespace)))

    def _extend_below(self, node: TreeNode, tokens: np.ndarray, slots: Sequence[int], start: int, now: int):
        """Match `tokens` (key[start:]) below `node` and add a leaf under the match's end for the rest, holding
        slots[start + matched:]: (that leaf, or the end when all matched; matched length; the matched slot
        arrays). From a leaf, the usual case, there is nothing below to match, nor to touch."""
        if node.children:
            end, matched, values = self._walk(node, tokens, now)
        else:
            end, matched, values = node, 0, []
        if matched < tokens.shape[0]:
            end = self._add_leaf(end, tokens[matched:], to_numpy_slots(slots[start + matched:]), now)
        return end, matched, values

    def _add_leaf(self, parent: TreeNode, tokens: np.ndarray, values: np.ndarray, now: int) -> TreeNode:
        """A new unlocked leaf under parent holding tokens -> values (copied: the tree must not alias
        arrays the caller may reuse or mutate)."""
        leaf = TreeNode(tokens.copy(), values.copy(), parent, now)
        parent.children[self._child_key(leaf.key)] = leaf
        parent.version += 1
        self._num_nodes += 1
        self._evictable += len(leaf.key)
        self._push(leaf)
        return leaf

    def insert_extending(self, node: TreeNode, start: int, key: Sequence[int], slots: Sequence[int],
                         namespace: str | None = None) -> tuple[int, TreeNode, torch.Tensor]:
        """As PrefixCache.insert_extending, in O(new tokens): the walk starts at `node` (the request's
        lock keeps it in the tree; a split above or inside it leaves its path as it was), not at the
        root, and only the nodes below it change lock counts. The path above is not touched (LRU): it is
        locked by the request, and touched when the request's KV is finally inserted at its end. A
        request with nothing cached yet holds its namespace's root: the walk starts there."""
        if not self._walks_from(node, namespace):
            return super().insert_extending(node, start, key, slots, namespace)
        n = len(key)
        assert n == len(slots) and n % self.page_size == 0 and start % self.page_size == 0 and start < n
        end, matched, values = self._extend_below(node, as_tokens(key[start:]), slots, start, self._tick())
        self._lock_path(end, stop=node)  # the lock moves from node to end: one more reference below node
        node.lock_ends -= 1
        end.lock_ends += 1
        if not values:
            return start, end, _NO_SLOTS
        return start + matched, end, torch.from_numpy(np.concatenate(values))

    def lock(self, node: TreeNode) -> None:
        assert not node.evicted, "lock of an evicted node"
        self._lock_path(node)
        node.lock_ends += 1

    def _lock_path(self, node: TreeNode, stop: TreeNode | None = None) -> None:
        """One more reference on every node from node up to (not including) stop, or the root."""
        while node is not stop and node.parent is not None:
            if node.lock_ref == 0:
                self._evictable -= len(node.key)
                self._protected += len(node.key)
            node.lock_ref += 1
            node = node.parent

    def unlock(self, node: TreeNode) -> None:
        assert not node.evicted, "unlock of an evicted node"
        assert node.lock_ends > 0, "unlock of a node no lock ends on"
        node.lock_ends -= 1
        end = node
        while node.parent is not None:
            assert node.lock_ref > 0, "unlock without a matching lock"
            node.lock_ref -= 1
            if node.lock_ref == 0:
                self._evictable += len(node.key)
                self._protected -= len(node.key)
            node = node.parent
        self._push(end)  # only the path's end can be a leaf; _push ignores it otherwise

    def is_private_leaf(self, node: TreeNode) -> bool:
        """`node` is a leaf, one lock ends on it and no other lock ends on its path (see
        PrefixCache.is_private_leaf): O(depth)."""
        if node is None or node.parent is None or node.evicted or node.children or node.lock_ends != 1:
            return False
        node = node.parent
        while node.parent is not None:
            if node.lock_ends:
                return False
            node = node.parent
        return True

    def evict(self, num_tokens: int) -> int:
        freed: list[np.ndarray] = []
        total = 0
        while total < num_tokens and self._heap:
            when, _, node = heapq.heappop(self._heap)
            if when != node.last_access or not self._is_evictable_leaf(node):
                continue  # stale entry
            parent = node.parent
            del parent.children[self._child_key(node.key)]
            parent.version += 1
            node.parent = None
            node.children = None
            freed.append(node.value)
            total += len(node.key)
            self._num_nodes -= 1
            self._evictable -= len(node.key)
            if parent.parent is None:
                self._drop_root_if_empty(parent)
            else:
                self._push(parent)
        if freed:
            self.allocator.free(np.concatenate(freed))
            self._evicted_tokens += total
        return total

    def shared_prefix_groups(self, nodes) -> list[tuple[int, list[int]]]:
        # Consecutive decode steps of one batch ask about the same nodes: the answer is kept. It depends
        # only on those nodes (held by the memo, so compared by identity, never by a reused id) and on
        # their ancestry, which inserts and evictions elsewhere leave alone: a split above a node adds an
        # ancestor with the node's own member set at a smaller depth, and the requests' locks keep their
        # paths from eviction. Callers must not mutate the result.
        nodes = tuple(nodes)
        memo = self._groups_memo
        if memo is not None and memo[1] == self._epoch and len(memo[0]) == len(nodes) and all(
                a is b for a, b in zip(memo[0], nodes)):
            return memo[2]
        groups = self._shared_prefix_groups(nodes)
        self._groups_memo = (nodes, self._epoch, groups)
        return groups

    def _shared_prefix_groups(self, nodes) -> list[tuple[int, list[int]]]:
        # The union of the requests' paths, each node visited once: a walk up stops at a node an earlier
        # walk reached (O(union), not O(sum of path lengths): a 40-turn chat history shared by 256
        # requests is 41 nodes, not 10k). Reported: the nodes where the member set changes (a request's
        # own node, or where two visited branches meet), each the deepest node with its member set;
        # the chain above it, up to the next such node, shares that set at a smaller depth.
        depth: dict[int, int] = {}
        parent: dict[int, int | None] = {}  # visited node -> visited parent (None: under a root)
        own: dict[int, list[int]] = {}
        for i, node in enumerate(nodes):
            if node is None or node.evicted or node.parent is None:
                continue
            chain, n = [], node
            while n.parent is not None and id(n) not in depth:
                chain.append(n)
                n = n.parent
            top = id(n) if n.parent is not None else None
            d = depth[top] if top is not None else 0
            for m in reversed(chain):
                d += len(m.key)
                depth[id(m)] = d
                parent[id(m)] = top
                top = id(m)
            own.setdefault(id(node), []).append(i)
        below: dict[int, list[list[int]]] = {}  # node -> member lists passed up by its visited children
        groups = []
        for k in sorted(depth, key=depth.__getitem__, reverse=True):
            parts = below.pop(k, [])
            mine = own.get(k)
            if mine is not None or len(parts) >= 2:
                members = sorted((mine or []) + [b for part in parts for b in part])
                if len(members) >= 2:
                    groups.append((depth[k], members))
            else:
                members = parts[0]  # a chain node: its one child's set, passed up as is
            if parent[k] is not None:
                below.setdefault(parent[k], []).append(members)
        return groups

    def evictable_size(self) -> int:
        return self._evictable

    def protected_size(self) -> int:
        return self._protected

    def reset(self) -> None:
        assert self._protected == 0, "reset while requests hold locks"
        nodes = list(self.nodes())
        if nodes:
            device = [n.value for n in nodes if n.value is not None]  # host-tier nodes may have none
            if device:
                self.allocator.free(np.concatenate(device))
        for node in nodes:  # stale handles held elsewhere now read as evicted
            node.parent, node.children = None, None
        self._roots = {None: self._new_root()}
        self._root_namespace = {}
        self._epoch += 1
        self._groups_memo = None
        self._heap = []
        self._evictable = 0
        self._num_nodes = 0

    def stats(self) -> dict[str, int]:
        # Hit/query/evicted counters are monotonic (Prometheus counters); reset() does not clear them.
        return {"hit_tokens": self._hit_tokens, "query_tokens": self._query_tokens,
                "cached_tokens": self._evictable + self._protected,
                "evicted_tokens": self._evicted_tokens, "nodes": self._num_nodes}

    # ---- inspection --------------------------------------------------------------------------------
    def nodes(self) -> Iterator[TreeNode]:
        """Every non-root node (O(tree); for checks, flush and debugging)."""
        stack = [c for r in self._roots.values() for c in r.children.values()]
        while stack:
            node = stack.pop()
            stack.extend(node.children.values())
            yield node

    def roots(self) -> dict[str | None, TreeNode]:
        return dict(self._roots)

    def pretty_print(self, max_tokens: int = 8) -> str:
        lines = []

        def show(node: TreeNode, depth: int) -> None:
            head = node.key[:max_tokens].tolist()
            more = "..." if len(node.key) > max_tokens else ""
            lines.append(f"{'  ' * depth}{head}{more} len={len(node.key)} lock={node.lock_ref} "
                         f"t={node.last_access}")
            for child in node.children.values():
                show(child, depth + 1)

        for ns, root in self._roots.items():
            lines.append(f"[namespace {ns!r}]")
            for child in root.children.values():
                show(child, 1)
        text = "\n".join(lines)
        print(text)
        return text

    # ---- internals ---------------------------------------------------------------------------------
    def _walk(self, root: TreeNode, tokens: np.ndarray, now: int):
        """Follow `tokens` (page-aligned length) from root, splitting the last edge at a partial match.
        Returns (deepest matched node, matched length, slot arrays along the path). Touches the path."""
        node, pos, values = root, 0, []
        for node, pos in self._descend(root, tokens, 0, now, _on_device):
            values.append(node.value)
        if node.parent is not None:
            self._push(node)  # touched leaf: its old heap entry is now stale (_push skips non-leaves)
        return node, pos, values

    def _descend(self, node: TreeNode, tokens: np.ndarray, pos: int, now: int, take):
        """From `node`, where tokens[:pos] are matched, follow tokens (page-aligned length) through the children
        `take` accepts, splitting an edge matched in part and touching each: yields (child, matched length).
        After a split the next lookup misses (the edges diverge inside the next page), ending the walk."""
        ps, n = self.page_size, tokens.shape[0]
        while pos < n:
            child = node.children.get(self._child_key(tokens[pos:pos + ps]))
            if child is None or not take(child):
                return
            m = common_prefix_len(child.key, tokens[pos:])
            m -= m % ps
            if m < len(child.key):
                child = self._split(child, m)
            child.last_access = now
            node, pos = child, pos + m
            yield child, pos

    def _split(self, child: TreeNode, m: int) -> TreeNode:
        """Cut child's edge after m tokens; the new upper node takes child's place and lock count
        (every lock through child also goes through it). Totals do not change."""
        parent = child.parent
        upper = TreeNode(child.key[:m].copy(), _head(child.value, m), parent, child.last_access)
        upper.lock_ref = child.lock_ref
        upper.host_value, upper.host_pending = _head(child.host_value, m), child.host_pending
        parent.children[self._child_key(upper.key)] = upper
        parent.version += 1
        child.key = child.key[m:].copy()
        child.value = _tail(child.value, m)
        child.host_value = _tail(child.host_value, m)
        child.parent = upper
        upper.children[self._child_key(child.key)] = child
        self._num_nodes += 1
        return upper

    def _peek(self, root: TreeNode, tokens: np.ndarray) -> tuple[TreeNode, int]:
        """Read-only walk: (deepest fully matched node, matched length including a page-aligned part of
        the next edge)."""
        node, pos = root, 0
        ps, n = self.page_size, tokens.shape[0]
        while pos < n:
            child = node.children.get(self._child_key(tokens[pos:pos + ps]))
            if child is None:
                break
            m = common_prefix_len(child.key, tokens[pos:])
            m -= m % ps
            if m < len(child.key):
                return node, pos + m
            node, pos = child, pos + m
        return node, pos

    def _child_key(self, tokens: np.ndarray):
        if self.page_size == 1:
            return int(tokens[0])
        return tuple(tokens[:self.page_size].tolist())

    def _is_evictable_leaf(self, node: TreeNode) -> bool:
        return node.parent is not None and node.lock_ref == 0 and not node.children

    def _push(self, node: TreeNode) -> None:
        if not self._is_evictable_leaf(node):
            return
        self._seq += 1
        heapq.heappush(self._heap, (node.last_access, self._seq, node))
        if len(self._heap) > 2 * self._num_nodes + 1024:
            self._heap = [e for e in self._heap if e[0] == e[2].last_access and self._is_evictable_leaf(e[2])]
            heapq.heapify(self._heap)

    def _drop_root_if_empty(self, root: TreeNode) -> None:
        """Per-tenant roots would otherwise pile up forever; the default root always stays."""
        ns = self._root_namespace.get(id(root))
        if ns is not None and not root.children:
            del self._roots[ns]
            del self._root_namespace[id(root)]
            self._epoch += 1

    def _new_root(self) -> TreeNode:
        return TreeNode(np.empty(0, np.int32), np.empty(0, np.int64), None, 0)

    def _tick(self) -> int:
        self._clock += 1
        return self._clock

    def _empty_slots(self) -> torch.Tensor:
        return torch.empty(0, dtype=torch.int64, device=self.device)
