"""Hands out KV pool slots a page at a time.

Bookkeeping lives on the host in numpy (a stack of free pages plus a boolean free map) so that alloc and
free cost a few vectorized ops regardless of pool size; only the returned slot ids go to `device`.
Page 0 is reserved (the padding target, see kv_pool.py) and is never handed out.
"""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch


@dataclass
class AllocatorCounters:
    allocs: int = 0  # successful alloc() calls
    failed_allocs: int = 0  # alloc() calls refused for lack of pages
    frees: int = 0  # free() calls
    peak_used_pages: int = 0


def to_numpy_slots(slots) -> np.ndarray:
    """Slot ids as a host int64 array, from a torch tensor (any device), numpy array or sequence."""
    if isinstance(slots, torch.Tensor):
        return slots.detach().to("cpu", torch.int64).numpy()
    return np.asarray(slots, dtype=np.int64)


class SlotAllocator:
    def __init__(self, num_pages: int, page_size: int, device: torch.device | str = "cpu"):
        assert num_pages > 0 and page_size > 0
        self.num_pages = num_pages  # usable pages: 1..num_pages
        self.page_size = page_size
        self.device = torch.device(device)
        self._offsets = np.arange(page_size, dtype=np.int64)
        self.counters = AllocatorCounters()
        self.reset()

    # ---- state -------------------------------------------------------------------------------------
    def reset(self) -> None:
        """Every usable page free again (e.g. after a flush with no running requests)."""
        # Popped from the end, so a fresh allocator hands out pages in ascending order.
        self._free_stack = np.arange(self.num_pages, 0, -1, dtype=np.int64)
        self._num_free = self.num_pages
        self._is_free = np.ones(self.num_pages + 1, dtype=bool)
        self._is_free[0] = False  # reserved page: never free, never allocated

    def available_size(self) -> int:
        return self._num_free * self.page_size

    def total_size(self) -> int:
        """Usable slots (excluding the reserved page)."""
        return self.num_pages * self.page_size

    def used_size(self) -> int:
        return self.total_size() - self.available_size()

    def is_page_free(self, page: int) -> bool:
        return bool(self._is_free[page])

    def free_pages(self) -> np.ndarray:
        """Copy of the free page ids (for checks and debugging)."""
        return self._free_stack[:self._num_free].copy()

    def stats(self) -> dict[str, int]:
        c = self.counters
        return {"available_tokens": self.available_size(), "used_tokens": self.used_size(),
                "total_tokens": self.total_size(), "allocs": c.allocs,
                "failed_allocs": c.failed_allocs, "frees": c.frees,
                "peak_used_tokens": c.peak_used_pages * self.page_size}

    # ---- alloc / free ------------------------------------------------------------------------------
    def alloc(self, n: int, last_slot: int = -1) -> torch.Tensor | None:
        """n slots, int64 on `device`, or None (nothing taken) if there are not enough free pages.

        last_slot >= 0 is the caller's current last slot: the rest of its page is used first, so a
        request keeps filling its own partially-filled page before taking fresh ones.
        """
        assert n >= 0
        if n == 0:
            return torch.empty(0, dtype=torch.int64, device=self.device)
        ps = self.page_size
        head = np.empty(0, dtype=np.int64)
        if last_slot >= 0 and (last_slot + 1) % ps != 0:
            assert ps <= last_slot < (self.num_pages + 1) * ps, f"bad last_slot {last_slot}"
            assert not self._is_free[last_slot // ps], f"last_slot {last_slot} is in a free page"
            tail_room = ps - 1 - last_slot % ps
            head = np.arange(last_slot + 1, last_slot + 1 + min(tail_room, n), dtype=np.int64)
        rest = n - head.shape[0]
        need_pages = -(-rest // ps)
        if need_pages > self._num_free:
            self.counters.failed_allocs += 1
            return None
        top = self._num_free
        pages = self._free_stack[top - need_pages:top][::-1]
        self._num_free = top - need_pages
        self._is_free[pages] = False
        fresh = (pages[:, None] * ps + self._offsets).ravel()[:rest]  # a new array, not a stack view
        slots = np.concatenate([head, fresh]) if head.shape[0] else fresh
        self.counters.allocs += 1
        self.counters.peak_used_pages = max(self.counters.peak_used_pages,
                                            self.num_pages - self._num_free)
        return torch.from_numpy(slots).to(self.device)

    def alloc_runs(self, counts: list[int], last_slots: list[int]) -> torch.Tensor | None:
        """counts[i] slots for each of several requests (a catch-up pass), concatenated in their order:
        the slots one alloc(counts[i], last_slots[i]) per request in that order would give, in one pass
        when pages are 1 slot (no request has a partly filled page then). None (nothing taken) if they
        do not all fit."""
        ps = self.page_size
        if ps > 1:  # partly filled pages come first: request by request, once the whole fits
            heads = [min(ps - 1 - last % ps, n) if last >= 0 and (last + 1) % ps else 0
                     for n, last in zip(counts, last_slots)]
            if sum(-(-(n - h) // ps) for n, h in zip(counts, heads)) > self._num_free:
                self.counters.failed_allocs += 1
                return None
            runs = [self.alloc(n, last) for n, last in zip(counts, last_slots)]
            return torch.cat(runs) if runs else torch.empty(0, dtype=torch.int64, device=self.device)
        total = sum(counts)
        if total > self._num_free:
            self.counters.failed_allocs += 1
            return None
        top = self._num_free
        # Popped from the top as alloc pops them, request after request.
        pages = self._free_stack[top - total:top][::-1].copy()
        self._num_free = top - total
        self._is_free[pages] = False
        self.counters.allocs += sum(1 for n in counts if n)
        self.counters.peak_used_pages = max(self.counters.peak_used_pages, self.num_pages - self._num_free)
        return torch.from_numpy(pages).to(self.device)

    def alloc_next(self, last_slots: list[int]) -> torch.Tensor | None:
        """One slot for each of several requests (a decode step), int64 on `device`, in their order:
        the slot after a request's last one while its page has room, else the first slot of a fresh page
        (last slot -1: no slot yet). None (nothing taken) if there are not enough free pages. The same
        slots as one alloc(1, last) per request in that order, in one pass."""
        last = np.asarray(last_slots, dtype=np.int64)
        ps = self.page_size
        fresh = np.ones(last.shape[0], dtype=bool) if ps == 1 else (last < 0) | ((last + 1) % ps == 0)
        need = int(fresh.sum())
        if need > self._num_free:
            self.counters.failed_allocs += 1
            return None
        out = last + 1
        if need < last.shape[0]:
            assert not self._is_free[last[~fresh] // ps].any(), "a last slot is in a free page"
        if need:
            top = self._num_free
            pages = self._free_stack[top - need:top][::-1]
            self._num_free = top - need
            self._is_free[pages] = False
            out[fresh] = pages * ps
        self.counters.allocs += 1
        self.counters.peak_used_pages = max(self.counters.peak_used_pages, self.num_pages - self._num_free)
        return torch.from_numpy(out).to(self.device)

    def free(self, slots) -> None:
        """Free the pages containing `slots` (torch tensor, numpy array or sequence).

        Each page must be in use and named by each of its slots at most once per call; anything else
        (double free, reserved or out-of-range slot) is a bookkeeping bug and raises AssertionError.
        """
        arr = to_numpy_slots(slots).ravel()
        if arr.shape[0] == 0:
            return
        ps = self.page_size
        lo, hi = int(arr.min()), int(arr.max())
        assert lo >= ps, f"freeing reserved or negative slot {lo}"
        assert hi < (self.num_pages + 1) * ps, f"freeing out-of-range slot {hi}"
        # Sort + neighbour compare: far cheaper than np.unique, and leaves pages ascending.
        srt = np.sort(arr)
        assert not (srt[1:] == srt[:-1]).any(), "slot freed twice in one call"
        if ps == 1:
            pages = srt
        else:
            pages = srt // ps
            pages = pages[np.concatenate(([True], pages[1:] != pages[:-1]))]
        already = self._is_free[pages]
        assert not already.any(), f"double free of pages {pages[already][:8].tolist()}"
        self._is_free[pages] = True
        top = self._num_free
        # Pushed descending so the next alloc pops them back in ascending (contiguous-friendly) order.
        self._free_stack[top:top + pages.shape[0]] = pages[::-1]
        self._num_free = top + pages.shape[0]
        self.counters.frees += 1
