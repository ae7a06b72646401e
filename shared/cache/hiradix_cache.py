"""The radix tree with a host-memory tier under it (SGLang's HiCache; --enable-hierarchical-cache).

Every node knows where its KV is: `value` (device pool slots) and `host_value` (host pool slots, host_pool.py),
either or both. Device-resident nodes stay closed upward (a node on the device has its parent on the device), so
a path from a root reads: device nodes, then host-only nodes. A match returns the device part as the plain
radix cache does, and reports the host-only continuation (MatchResult.host); load_back() brings it back.

Device eviction takes least recently used device leaves (nodes without a device child): a leaf with a complete host
copy just drops its device slots (host-only from then on). One without is copied to the host first under write_back
(eviction waits for that copy); under the write-through policies it leaves the tree as in the one-tier cache (its
copy was lost to the host's LRU, never made, or is still on the way: a scheduling step never waits for one). The
host pool evicts its own least recently used leaves (nodes without a host child): a node also on the device
drops its host copy; a host-only node leaves the tree. When the host pool cannot hold a node being evicted from
the device, it is dropped as the plain tree drops it (with its host-only subtree): eviction never fails for lack
of host room.

Write policies (SGLang's names): write_through copies every new leaf to the host as it is inserted (the copy
overlaps later passes; eviction then only drops device slots); write_through_selective copies a node the first
time a match reuses it; write_back copies at eviction, and eviction then waits for the copy (the device slots
are reused at once). See docs/design.md.

Loads: load_back() allocates device slots for the host-only nodes, starts the host-to-device copy (its own
stream, an event; host_pool.py) and marks the nodes loading (a match stops before them; a request whose match
reaches them waits on the same load). poll(), once a scheduling round, finishes loads whose event completed: the
nodes become device-resident and the requests waiting on them match them next round. A load that fails to start
or outlives the timeout is abandoned: its nodes are host-only again, the requests recompute that prefix, and the
device slots it was given return to the allocator once its copy has ended.

Under tensor parallelism the tree lives on rank 0 only; `host` is then rank 0's LeaderHostKVPool, which has every
copy made on the other ranks too, each in its own host pool of its KV heads (host_pool.py).
"""
from __future__ import annotations

import bisect
import heapq
import logging
import time
from dataclasses import dataclass, field
from typing import Sequence

import numpy as np

from shared.cache.allocator import SlotAllocator, to_numpy_slots
from shared.cache.base import MatchResult
from shared.cache.host_pool import HostKVPool, event_done
from shared.cache.radix_cache import RadixCache, TreeNode, as_tokens, common_prefix_len

log = logging.getLogger(__name__)

WRITE_POLICIES = ("write_back", "write_through", "write_through_selective")
# Upper bounds (seconds) of the load-back latency histogram's buckets, and one more bucket for everything longer.
LOAD_LATENCY_BOUNDS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5)


@dataclass(eq=False)
class LoadOp:
    """One host-to-device load of a path's host-only nodes (top down), and the requests waiting on it."""
    nodes: list
    slots: np.ndarray  # device slots, in the nodes' order
    event: object  # CUDA event, None when done at once (CPU)
    started: float
    held: TreeNode  # locked while the load or its waiters need the path: the device end, then the last node
    holders: int = 1  # requests waiting on it (release_load)
    state: str = "loading"  # loading | done | failed (timed out) | superseded (its KV was recomputed meanwhile)


@dataclass(eq=False)
class HostMatch:
    """MatchResult.host: the host-only nodes continuing the device match, or the load in flight there."""
    nodes: list = field(default_factory=list)
    loading: LoadOp | None = None
    recorded: int = -1  # query tokens the match counted (-1: none; undone when it only starts a load)


class HiRadixCache(RadixCache):
    def __init__(self, allocator: SlotAllocator, page_size: int, host_pool: HostKVPool,
                 write_policy: str = "write_through", load_timeout: float = 5.0):
        if write_policy not in WRITE_POLICIES:
            raise ValueError(f"--hicache-write-policy {write_policy!r}: use one of {', '.join(WRITE_POLICIES)}")
        assert host_pool.page_size == page_size
        super().__init__(allocator, page_size)
        self.host = host_pool
        self.host_allocator = host_pool.allocator
        self.write_policy = write_policy
        self.load_timeout = load_timeout
        self._host_heap: list[tuple[int, int, TreeNode]] = []
        self._host_tokens = 0  # tokens with a host copy (pending copies included)
        self._loading: dict[int, LoadOp] = {}  # id(node) -> the load bringing it back
        self._loads: list[LoadOp] = []  # in flight
        self._deferred_free: list[tuple[object, np.ndarray]] = []  # (event, device slots) of abandoned loads
        self._batch, self._queued = _Copies(), []  # device-to-host copies not issued yet: (device, host slots)
        self._host_free_later: list[tuple[_Copies, np.ndarray]] = []  # host slots of copies dropped on the way
        self.counters = {"host_hit_tokens": 0, "load_failures": 0, "bytes_h2d": 0, "bytes_d2h": 0,
                         "written_tokens": 0, "host_evicted_tokens": 0, "load_seconds_sum": 0.0,
                         "load_copy_seconds_sum": 0.0}
        self.load_latency = [0] * (len(LOAD_LATENCY_BOUNDS) + 1)  # per bucket (not cumulative)

    # ---- matching ----------------------------------------------------------------------------------
    def match_prefix(self, key: Sequence[int], namespace: str | None = None, record: bool = True) -> MatchResult:
        match = super().match_prefix(key, namespace, record)
        if self.write_policy == "write_through_selective" and record and match.length:
            self._back_up_path(match.node)
        node = match.node
        if not node.children or namespace not in self._roots:  # (an unknown namespace's match holds the default root)
            return match
        tokens = as_tokens(key)
        ps = self.page_size
        n = tokens.shape[0] - tokens.shape[0] % ps
        pos, found = match.length, HostMatch()
        for node, pos in self._descend(node, tokens, pos, self._tick(), self._loadable):
            found.nodes.append(node)
        if pos < n:  # stopped at a node being loaded: the request waits on that load
            child = node.children.get(self._child_key(tokens[pos:pos + ps]))
            found.loading = None if child is None else self._loading.get(id(child))
        if found.nodes or found.loading is not None:
            found.recorded = tokens.shape[0] if record else -1  # what the match counted as queried
            match.host_hit_length = pos - match.length
            match.host = found
        return match

    def _loadable(self, node: TreeNode) -> bool:
        return node.value is None and node.host_value is not None and id(node) not in self._loading

    # ---- loads -------------------------------------------------------------------------------------
    def load_back(self, match: MatchResult) -> LoadOp | None:
        """Start bringing the match's host-only continuation back to the device (or join the load already
        doing so). The caller waits until load_ready(), matches again (a device hit now) and then calls
        release_load(). None: nothing can be loaded (no device room, the copy failed): a miss."""
        found: HostMatch | None = match.host
        if found is None:
            return None
        if found.loading is not None:
            found.loading.holders += 1
            self._uncount(match)
            return found.loading
        nodes = found.nodes
        n = sum(len(x.key) for x in nodes)
        self.lock(match.node)
        op = LoadOp(nodes, np.empty(0, np.int64), None, time.monotonic(), match.node)
        for x in nodes:  # pinned first: the eviction below must not drop them from the host
            self._loading[id(x)] = op
        if self.allocator.available_size() < n:
            self.evict(n - self.allocator.available_size())
        slots = self.allocator.alloc(n)
        if slots is None:
            self._unpin(op)
            self.unlock(match.node)
            return None
        op.slots = slots.numpy()
        try:
            op.event = self.host.load(np.concatenate([x.host_value for x in nodes]), op.slots)
        except Exception:
            log.exception("host KV load-back failed: the prefix is recomputed")
            self.counters["load_failures"] += 1
            self.allocator.free(op.slots)
            self._unpin(op)
            self.unlock(match.node)
            return None
        self._loads.append(op)
        self._uncount(match)
        if op.event is None:
            self._finish_load(op)
        return op

    def _uncount(self, match: MatchResult) -> None:
        """A load started or joined: the request's match once it is done counts this query, not `match` (a match
        that loads nothing stays counted)."""
        if match.host.recorded >= 0:
            self._query_tokens -= match.host.recorded
            self._hit_tokens -= match.length

    def load_ready(self, op: LoadOp) -> bool:
        """Whether the requests waiting on `op` may go on: it completed, failed, or ran past the timeout
        (then it is abandoned and they recompute)."""
        if op.state == "loading":
            self.poll()
        if op.state == "loading" and time.monotonic() - op.started > self.load_timeout:
            log.warning("host KV load-back of %d tokens exceeded %.1f s: the prefix is recomputed",
                        len(op.slots), self.load_timeout)
            self._abandon(op)
        return op.state != "loading"

    def load_failed(self, op: LoadOp) -> bool:
        """Whether `op` outlived the timeout (then abandoned: its waiters recompute the prefix)."""
        return op.state == "failed"

    def release_load(self, op: LoadOp) -> None:
        """A request no longer waits on `op` (it matched and locked the path itself, or it left)."""
        assert op.holders > 0, "release of a load nobody holds"
        op.holders -= 1
        if op.holders == 0 and op.state != "loading":
            self.unlock(op.held)

    def poll(self) -> None:
        if self._queued:
            self._issue_writes()
        if self._host_free_later:
            self._host_free_later, done = _split_done(self._host_free_later, lambda batch: batch.event)
            if done:
                self.host_allocator.free(np.concatenate(done))
        if self._loads:
            for op in [op for op in self._loads if event_done(op.event)]:
                self._finish_load(op)
        if self._deferred_free:
            self._deferred_free, done = _split_done(self._deferred_free, lambda event: event)
            if done:
                self.allocator.free(np.concatenate(done))

    def copies_hold_slots(self) -> bool:
        return bool(self._loads or self._deferred_free)

    def _finish_load(self, op: LoadOp) -> None:
        self._loads.remove(op)
        self._unpin(op)
        offset = 0
        for x in op.nodes:
            x.value = op.slots[offset:offset + len(x.key)].copy()
            offset += len(x.key)
            self._evictable += len(x.key)
        last = op.nodes[-1]
        self.lock(last)  # the waiters' path stays on the device until they lock it themselves
        self.unlock(op.held)
        op.held, op.state = last, "done"
        self._push(last)
        seconds = time.monotonic() - op.started
        if op.event is not None:  # (host_pool.Transfer)
            self.counters["load_copy_seconds_sum"] += op.event.seconds()
        self.counters["host_hit_tokens"] += offset
        self.counters["bytes_h2d"] += offset * self.host.bytes_per_token
        self.counters["load_seconds_sum"] += seconds
        self.load_latency[bisect.bisect_left(LOAD_LATENCY_BOUNDS, seconds)] += 1
        if op.holders == 0:
            self.unlock(op.held)

    def _abandon(self, op: LoadOp, state: str = "failed") -> None:
        """Give up a load in flight: its nodes are host-only again; its device slots are freed when the copy ends."""
        self._loads.remove(op)
        self._unpin(op)
        self._deferred_free.append((op.event, op.slots))
        op.state = state
        if state == "failed":
            self.counters["load_failures"] += 1
        if op.holders == 0:
            self.unlock(op.held)

    def _unpin(self, op: LoadOp) -> None:
        for x in op.nodes:
            if self._loading.get(id(x)) is op:
                del self._loading[id(x)]

    # ---- inserts -----------------------------------------------------------------------------------
    def _add_leaf(self, parent: TreeNode, tokens: np.ndarray, values: np.ndarray, now: int) -> TreeNode:
        """The new KV first fills host-only nodes on its path (the walk stopped before them): they are on the
        device again with the slots given, then a leaf takes the rest (copied to the host under write_through)."""
        ps = self.page_size
        while tokens.shape[0]:
            child = parent.children.get(self._child_key(tokens[:ps]))
            if child is None:
                break
            assert child.value is None, "the walk stopped before a node with device KV"
            op = self._loading.get(id(child))
            if op is not None:  # recomputed meanwhile: the load is not needed any more
                self._abandon(op, "superseded")
            m = common_prefix_len(child.key, tokens)
            m -= m % ps
            if m < len(child.key):
                child = self._split(child, m)
            child.value = values[:m].copy()
            child.last_access = now
            self._evictable += m
            parent, tokens, values = child, tokens[m:], values[m:]
        if not tokens.shape[0]:
            self._push(parent)
            return parent
        leaf = super()._add_leaf(parent, tokens, values, now)
        if self.write_policy == "write_through":
            self._back_up(leaf)
        return leaf

    # ---- device eviction ---------------------------------------------------------------------------
    def _is_evictable_leaf(self, node: TreeNode) -> bool:
        return (node.parent is not None and node.value is not None and node.lock_ref == 0
                and not any(c.value is not None for c in node.children.values()))

    def evict(self, num_tokens: int) -> int:
        self.poll()
        total = 0
        freed: list[np.ndarray] = []
        while total < num_tokens and self._heap:
            when, _, node = heapq.heappop(self._heap)
            if when != node.last_access or not self._is_evictable_leaf(node):
                continue  # stale entry
            if node.host_value is not None and not self._copy_done(node) and self.write_policy != "write_back":
                self._drop_host_copy(node)  # its copy is still on the way: waiting for it has no place here
            if node.host_value is None and self.write_policy == "write_back":
                self._back_up(node)
            if node.host_value is None:  # no host copy (or no host room): dropped as the plain tree drops it
                freed.append(node.value)
                total += len(node.key)
                self._evictable -= len(node.key)
                self._remove(node)
                continue
            self._wait(node)  # write_back: the device slots are reused once the copy has read them (the one wait)
            freed.append(node.value)
            total += len(node.key)
            self._evictable -= len(node.key)
            node.value = None
            self._push(node.parent)
            self._push_host(node)
        if freed:
            self.allocator.free(np.concatenate(freed))
            self._evicted_tokens += total
        return total

    def _remove(self, node: TreeNode) -> None:
        """Take a node without device KV and its (host-only) subtree out of the tree, freeing their host slots."""
        if self.listener is not None:  # leaving the last tier: a removal for routing (a move to the host is not)
            stack = [node]
            while stack:
                x = stack.pop()
                stack.extend(x.children.values())
                self.listener.removed(x, "host" if x.value is None else "device")
        parent = node.parent
        del parent.children[self._child_key(node.key)]
        parent.version += 1
        stack, host = [node], []
        while stack:
            x = stack.pop()
            stack.extend(x.children.values())
            if x.host_value is not None:
                self._wait(x)
                host.append(x.host_value)
                self._host_tokens -= len(x.host_value)
            x.parent, x.children = None, None
            self._num_nodes -= 1
        if host:
            self.host_allocator.free(np.concatenate(host))
        if parent.parent is None:
            self._drop_root_if_empty(parent)
        else:
            self._push(parent)
            self._push_host(parent)

    # ---- the host pool -----------------------------------------------------------------------------
    def _back_up(self, node: TreeNode) -> None:
        """Queue a device node's copy to the host (none when the host pool has no room, even after its eviction).
        The queue is issued as one transfer at the next poll(), or at once when a node of it must be complete."""
        n = len(node.key)
        slots = self._alloc_host(n)
        if slots is None:
            return
        self._queued.append((node.value, slots))
        node.host_value, node.host_pending = slots, self._batch
        self._host_tokens += n
        self.counters["written_tokens"] += n
        self.counters["bytes_d2h"] += n * self.host.bytes_per_token
        self._push_host(node)

    def _issue_writes(self) -> None:
        if not self._queued:
            return
        batch, queued = self._batch, self._queued
        self._batch, self._queued = _Copies(), []
        batch.issued = True
        try:
            batch.event = self.host.write(np.concatenate([d for d, _ in queued]), np.concatenate([h for _, h in queued]))
        except Exception:
            log.exception("host KV write failed: the nodes concerned stay on the device only")
            for x in self.nodes():  # rare: O(tree)
                if x.host_pending is batch:
                    self.host_allocator.free(x.host_value)
                    self._host_tokens -= len(x.host_value)
                    x.host_value, x.host_pending = None, None  # (never host-only: eviction waits for the copy)

    def _copy_done(self, node: TreeNode) -> bool:
        """Whether the node's copy to the host is complete (no waiting)."""
        batch = node.host_pending
        if batch is not None and batch.issued and event_done(batch.event):
            node.host_pending = batch = None
        return batch is None

    def _drop_host_copy(self, node: TreeNode) -> None:
        """Forget a copy still on the way; its host slots are freed once it has landed."""
        batch = node.host_pending
        if not batch.issued:
            self._issue_writes()
        self._host_free_later.append((batch, node.host_value))
        self._host_tokens -= len(node.host_value)
        node.host_value, node.host_pending = None, None

    def _wait(self, node: TreeNode) -> None:
        """The node's copy to the host is complete (waits for it in the rare case it is not)."""
        batch = node.host_pending
        if batch is None:
            return
        if not batch.issued:
            self._issue_writes()
        if not event_done(batch.event):
            batch.event.synchronize()
        node.host_pending = None

    def _back_up_path(self, node: TreeNode) -> None:
        while node.parent is not None:
            if node.host_value is None:
                self._back_up(node)
            node = node.parent

    def _alloc_host(self, n: int) -> np.ndarray | None:
        if self.host_allocator.available_size() < n:
            self._evict_host(n - self.host_allocator.available_size())
        slots = self.host_allocator.alloc(n)
        return None if slots is None else slots.numpy()

    def _is_host_leaf(self, node: TreeNode) -> bool:
        return (node.parent is not None and node.host_value is not None and id(node) not in self._loading
                and not any(c.host_value is not None for c in node.children.values()))

    def _push_host(self, node: TreeNode) -> None:
        if self._is_host_leaf(node):
            self._seq += 1
            heapq.heappush(self._host_heap, (node.last_access, self._seq, node))
            if len(self._host_heap) > 2 * self._num_nodes + 1024:  # entries left behind by nodes that changed
                self._host_heap = [e for e in self._host_heap if self._is_host_leaf(e[2])]
                heapq.heapify(self._host_heap)

    def _evict_host(self, num_tokens: int) -> int:
        total, copying = 0, []
        while total < num_tokens and self._host_heap:
            when, _, node = heapq.heappop(self._host_heap)
            if not self._is_host_leaf(node):
                continue
            if when != node.last_access:  # touched since: back in at its new place
                self._push_host(node)
                continue
            if not self._copy_done(node):  # (on the device too) its copy is on the way: kept, not waited for
                copying.append(node)
                continue
            n = len(node.host_value)
            total += n
            if node.value is None:  # host-only (so without children): out of the tree
                self._remove(node)
            else:
                self.host_allocator.free(node.host_value)
                node.host_value, node.host_pending = None, None
                self._host_tokens -= n
                self._push_host(node.parent)
        for node in copying:
            self._push_host(node)
        self.counters["host_evicted_tokens"] += total
        return total

    # ---- whole-cache -------------------------------------------------------------------------------
    def reset(self) -> None:
        for op in list(self._loads):
            op.event is not None and op.event.synchronize()
            self._finish_load(op)
        for event in [e for e, _ in self._deferred_free] + [b.event for b, _ in self._host_free_later]:
            event is not None and event.synchronize()
        self.poll()
        host = []
        for node in self.nodes():
            if node.host_value is not None:
                self._wait(node)
                host.append(node.host_value)
        super().reset()
        if host:
            self.host_allocator.free(np.concatenate(host))
        self._host_heap, self._host_tokens = [], 0

    def stats(self) -> dict:
        s = super().stats()
        s.update(self.counters)
        s["load_seconds_count"] = sum(self.load_latency)
        s["load_latency_buckets"] = list(self.load_latency)  # per bucket, not cumulative
        s["load_latency_le"] = list(LOAD_LATENCY_BOUNDS)
        s["host_cached_tokens"] = self._host_tokens
        s["loads_in_flight"] = len(self._loads)
        return s

    def tiers(self) -> dict:
        """Sizes of both tiers, in tokens (for /server_info)."""
        return {"device_total_tokens": self.allocator.total_size(),
                "device_used_tokens": self.allocator.used_size(),
                "host_total_tokens": self.host_allocator.total_size(),
                "host_used_tokens": self.host_allocator.used_size(),
                "host_bytes": self.host.buffer.numel() * self.host.buffer.element_size(),
                "write_policy": self.write_policy}


class _Copies:
    """One batch of device-to-host copies: queued as nodes are backed up, issued together (one transfer) at the
    next poll or when a node of it must be complete; `event` once issued. Nodes of the batch (splits included)
    point to it through host_pending."""
    __slots__ = ("event", "issued")

    def __init__(self):
        self.event, self.issued = None, False


def _split_done(entries: list, event_of) -> tuple[list, list]:
    """(the entries whose copy is still on the way, the slots of those whose copy has ended) of (handle, slots)
    entries: each event queried once, as a copy may end between two queries (then asked twice it reads as neither
    pending nor done, and its slots are lost)."""
    pending, done = [], []
    for handle, slots in entries:
        if event_done(event_of(handle)):
            done.append(slots)
        else:
            pending.append((handle, slots))
    return pending, done

