"""The `--disable-radix-cache` ablation: a prefix cache that never remembers anything.

Callers follow the same protocol as with RadixCache; because nothing ever matches, insert returns 0,
which per the PrefixCache contract hands every slot to the cache, and this cache drops them at once.
"""
from __future__ import annotations

from typing import Sequence

import torch

from shared.cache.allocator import SlotAllocator
from shared.cache.base import MatchResult, PrefixCache


class _NoNode:
    """Handle returned by match; locking it protects nothing because nothing is cached."""

    __slots__ = ()


_NO_NODE = _NoNode()


class NoPrefixCache(PrefixCache):
    retains = False

    def __init__(self, allocator: SlotAllocator, page_size: int):
        assert page_size == allocator.page_size
        self.allocator = allocator
        self.page_size = page_size
        self._query_tokens = 0

    def match_prefix(self, key: Sequence[int], namespace: str | None = None, record: bool = True) -> MatchResult:
        if record:
            self._query_tokens += len(key)
        return MatchResult(torch.empty(0, dtype=torch.int64, device=self.allocator.device), _NO_NODE)

    def match_length(self, key, namespace=None, memo=None):
        return 0, None

    def insert(self, key: Sequence[int], slots: torch.Tensor, namespace: str | None = None) -> int:
        assert len(key) == len(slots) and len(key) % self.page_size == 0
        self.allocator.free(slots)
        return 0

    def lock(self, node) -> None:
        pass

    def unlock(self, node) -> None:
        pass

    def evict(self, num_tokens: int) -> int:
        return 0

    def evictable_size(self) -> int:
        return 0

    def protected_size(self) -> int:
        return 0

    def reset(self) -> None:
        pass

    def stats(self) -> dict[str, int]:
        return {"hit_tokens": 0, "query_tokens": self._query_tokens, "cached_tokens": 0,
                "evicted_tokens": 0, "nodes": 0}
