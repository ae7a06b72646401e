"""The prefix-cache interface the scheduler talks to. RadixCache is one implementation; NoPrefixCache
(the `--disable-radix-cache` ablation) is the other."""
from __future__ import annotations

from abc import ABC, abstractmethod
from dataclasses import dataclass
from typing import Any, Sequence

import torch


@dataclass
class MatchResult:
    slots: torch.Tensor  # [n] int64 pool slots of the matched prefix (n is a multiple of page_size)
    node: Any  # handle to lock/unlock; pass back to insert/unlock only
    # Host tier (HiRadixCache): tokens past `slots` whose KV is in host memory only, and the cache's handle
    # on them for load_back(). 0 / None for every other cache.
    host_hit_length: int = 0
    host: Any = None

    @property
    def length(self) -> int:
        return int(self.slots.shape[0])


class PrefixCache(ABC):
    page_size: int
    # Whether insert() keeps what it is given. The ablation cache frees it at once, so callers must not
    # hand it KV a running request still reads (insert at prefill end is skipped for it).
    retains: bool = True

    @abstractmethod
    def match_prefix(self, key: Sequence[int], namespace: str | None = None, record: bool = True) -> MatchResult:
        """Longest cached prefix of `key`, page-aligned. Touches the path (LRU). Counts query/hit tokens
        unless record is False (bookkeeping re-matches that are not admissions)."""

    def match_length(self, key: Sequence[int], namespace: str | None = None, memo=None) -> tuple[int, object]:
        """Length of the longest cached prefix of `key`, for ordering only (no counters, no LRU touch
        promised). `memo` is what the previous call for the same key returned; an implementation may
        answer from it without walking the tree when nothing the answer depends on changed.
        Returns (length, memo for the next call)."""
        return self.match_prefix(key, namespace, record=False).length, None

    def shared_prefix_groups(self, nodes: Sequence[Any]) -> list[tuple[int, list[int]]]:
        """For requests holding locks on `nodes` (as returned by match/insert): (prefix length, their
        indices, ascending) for every set of at least two of them that share a node, at the deepest node
        they share. Groups nest: a deeper group's indices are a subset of a shallower one's, and an index
        is in one group per branching of the tree above it; the attention backend picks one per request
        (AttentionBackend.select_prefix_groups). A group's first prefix-length slots are the same pool
        slots for all its members."""
        return []

    @abstractmethod
    def insert(self, key: Sequence[int], slots: torch.Tensor, namespace: str | None = None) -> int:
        """Insert key -> slots (len(key) == len(slots), a multiple of page_size). Returns how many
        leading tokens were already cached; the caller still owns slots[:returned] and must free those of
        them that are not its own locked prefix. The tree owns slots[returned:] from now on."""

    def insert_from(self, node: Any, start: int, key: Sequence[int], slots: Sequence[int],
                    namespace: str | None = None) -> int:
        """insert(key, slots) by a request holding one lock on `node`, whose path is key[:start]: the
        same result and the same tree (an implementation may skip matching that path again)."""
        return self.insert(key, torch.as_tensor(slots, dtype=torch.int64), namespace=namespace)

    def insert_extending(self, node: Any, start: int, key: Sequence[int], slots: Sequence[int],
                         namespace: str | None = None) -> tuple[int, Any, torch.Tensor]:
        """A running request's KV grows in the tree: it holds one lock on `node`, whose path is
        key[:start], and now inserts key -> slots (whole, page-aligned, start < len(key)); its lock moves
        to the node ending at len(key). Returns (leading tokens already cached, as insert() does; never
        less than start), the new node, and the tree's slots of key[start:returned] (the caller's own
        slots for those positions are not the tree's: it frees them and switches to these)."""
        returned = self.insert(key, torch.as_tensor(slots, dtype=torch.int64), namespace=namespace)
        assert returned >= start, (returned, start)
        match = self.match_prefix(key, namespace=namespace, record=False)
        assert match.length == len(key), (match.length, len(key))
        self.lock(match.node)
        self.unlock(node)
        return returned, match.node, match.slots[start:returned].cpu()

    def is_private_leaf(self, node: Any) -> bool:
        """Whether `node` (held by one request) is a leaf that no other request's lock ends on or above:
        the request's insert_extending below it then adds a leaf without walking, and no other request's
        insert, release or lock can reach under it, so it yields the same tree, slots and counts in
        whatever order it runs among theirs. False when unsure."""
        return False

    def poll(self) -> None:
        """Once a scheduling round: take note of background copies that completed (the host tier)."""

    def copies_hold_slots(self) -> bool:
        """Whether background copies hold device slots that come back without any request's help (the host tier's
        loads in flight, and abandoned loads whose copy has not ended): a request that does not fit the pool now
        may fit once they end, so it waits rather than fails."""
        return False

    @abstractmethod
    def lock(self, node: Any) -> None:
        """Protect the path root..node from eviction (one reference)."""

    @abstractmethod
    def unlock(self, node: Any) -> None:
        """Drop one reference taken by lock()."""

    @abstractmethod
    def evict(self, num_tokens: int) -> int:
        """Free at least num_tokens slots from unlocked leaves, least recently used first, back to the
        allocator. Returns how many were freed (may be fewer if not enough are evictable)."""

    @abstractmethod
    def evictable_size(self) -> int:
        """Tokens held by the tree that no lock protects."""

    @abstractmethod
    def protected_size(self) -> int:
        """Tokens held by the tree under at least one lock."""

    @abstractmethod
    def reset(self) -> None:
        """Drop everything (flush). Only valid when nothing is locked; frees all slots."""

    @abstractmethod
    def stats(self) -> dict[str, int]:
        """{"hit_tokens", "query_tokens", "cached_tokens", "evicted_tokens", "nodes"} counters."""
