"""One admission round of the scheduler: what goes into the next EXTEND batch.

The adder owns the round's token budget (max_prefill_tokens), the memory reservation (slots held back
for the future decode tokens of everything running or admitted, `SchedulePolicy._reserve_of`), and the
in-batch dedupe of shared prefixes. Each `add_*` either takes a request whole (slots allocated, KV
bookkeeping set) or leaves everything as it was. It works on its scheduler through Admitting.
"""
from __future__ import annotations

from typing import TYPE_CHECKING, Protocol

import torch

from shared.models.forward_batch import ForwardMode
from shared.engine.request import Req
from shared.engine.schedule_batch import ScheduleBatch
from shared.knobs import knob

if TYPE_CHECKING:
    from shared.cache.allocator import SlotAllocator
    from shared.cache.base import MatchResult, PrefixCache
    from shared.cache.kv_pool import ReqToTokenPool
    from shared.engine.config import EngineConfig
    from shared.pd.stages import DecodeStages, PrefillStages

# In-batch dedupe: requests of one admission round whose next uncached tokens are the same (the same
# cached prefix, then these many equal tokens) compute them once: the first goes, the others wait a round
# and hit what it inserted when its pass was launched. The chunked request claims its next tokens too,
# so siblings arriving while a long shared prompt is prefilled chunk by chunk do not compute its rest.
INBATCH_SHARE_TOKENS = knob("INBATCH_SHARE_TOKENS")
# A request waits at most this many rounds for siblings (aged ones too: the wait is one round each, so
# it cannot starve; without the wait each sibling recomputes the shared prompt: docs/kernels.md).
MAX_SIBLING_DEFERRALS = knob("MAX_SIBLING_DEFERRALS")


class Admitting(Protocol):
    """What an admission round uses of its scheduler (shared/engine/schedule_policy.py's SchedulePolicy): the pools,
    the queues, the reservation figures, and the scheduler's own steps for a request it takes."""
    config: EngineConfig
    cache: PrefixCache
    allocator: SlotAllocator
    req_pool: ReqToTokenPool
    page_size: int
    waiting: list[Req]
    running: list[Req]
    chunked: Req | None
    failed: list[Req]
    prefill_stages: PrefillStages
    decode_stages: DecodeStages

    def num_running(self) -> int: ...
    def _reserve_of(self, req: Req) -> float: ...
    def _reserved_tokens(self) -> float: ...
    def _free_tokens(self) -> int: ...
    def _holds_kv(self) -> bool: ...
    def _evict_for(self, tokens: int) -> None: ...
    def _admission_match(self, req: Req) -> MatchResult | None: ...
    def drop_host_load(self, req: Req) -> None: ...
    def _bind(self, req: Req, match: MatchResult) -> None: ...
    def _unbind(self, req: Req) -> None: ...
    def _mark_admitted(self, req: Req, cached: int) -> None: ...
    def _prefill_done(self, req: Req) -> None: ...
    def _retract(self, req: Req) -> None: ...


def max_riders(budget: int) -> int:
    """Most running requests that ride along (mixed chunks) in a pass of `budget` new tokens: under half of it."""
    return max(0, (budget - 1) // 2)


def chunk_len(remaining: int, chunk_size: int, budget: int) -> int:
    """New tokens of one prompt a pass takes: the rest of it, at most a chunk and what the pass has left."""
    return min(remaining, chunk_size, budget)


class PrefillAdder:
    def __init__(self, sched: Admitting):
        self.s = sched
        self.budget = sched.config.max_prefill_tokens
        self.reserve = sched._reserved_tokens()
        self.reqs: list[Req] = []
        self.prefix_lens: list[int] = []
        self.extend_lens: list[int] = []
        self.sample: list[bool] = []
        self.locs: list[torch.Tensor] = []
        self.admitted = 0
        self.last_need = 0  # tokens the last refused chunk needed (for retraction)
        self._shared_keys: set[tuple] = set()
        # PD: a transfer that did not fit its side's budget this round; the later ones wait behind it (in
        # order), requests without a transfer still go.
        self._transfers_wait = False

    # ------------------------------------------------------------------ reservation
    def _busy(self) -> bool:
        """Something else holds KV that will come back without this round's help, so a request that
        does not fit may wait (otherwise it is tried anyway, and fails only if the pool is too small)."""
        return bool(self.reqs) or self.s._holds_kv()

    def fits(self, req: Req, need: int) -> bool:
        """need new slots now plus the request's own decode reservation fit beside everyone else's."""
        s = self.s
        return s._free_tokens() >= need + self.reserve + s._reserve_of(req) or not self._busy()

    # ------------------------------------------------------------------ taking
    def _take(self, req: Req, ext: int) -> bool:
        """Allocate ext slots after the request's KV and put its next ext tokens into the batch."""
        s = self.s
        s._evict_for(ext)
        slots = s.allocator.alloc(ext, req.slots[-1] if req.slots else -1)
        if slots is None:
            return False
        self.reqs.append(req)
        self.prefix_lens.append(req.kv_len)
        self.extend_lens.append(ext)
        self.sample.append(req.kv_len + ext == req.seq_len)
        self.locs.append(slots)
        req.slots.extend(slots.tolist())
        self.budget -= ext
        return True

    def _take_all(self, reqs: list[Req], exts: list[int]) -> bool:
        """`_take` for every request at once (one allocation, not one per row), when they all fit the
        budget and the free slots without evicting; else False, nothing taken."""
        s = self.s
        total = sum(exts)
        if total > self.budget or total > s.allocator.available_size():
            return False
        slots = s.allocator.alloc_runs(exts, [req.slots[-1] if req.slots else -1 for req in reqs])
        if slots is None:
            return False
        flat, pos = slots.tolist(), 0
        for req, ext in zip(reqs, exts):
            self.reqs.append(req)
            self.prefix_lens.append(req.kv_len)
            self.extend_lens.append(ext)
            self.sample.append(req.kv_len + ext == req.seq_len)
            req.slots.extend(flat[pos:pos + ext])
            pos += ext
        self.locs.append(slots)  # the rows' slots in row order, as one _take per row appends them
        self.budget -= total
        return True

    def add_chunk(self, req: Req) -> bool:
        """The next chunk of the request being prefilled in pieces."""
        s = self.s
        ext = chunk_len(req.seq_len - req.kv_len, s.config.chunked_prefill_size, self.budget)
        if not self._take(req, ext):
            self.last_need = ext
            return False
        key = self._next_tokens_key(req, req.cached_len, req.last_node)
        if key is not None:
            self._shared_keys.add(key)  # siblings matching up to its inserted chunks wait for the rest
        if req.kv_len + ext == req.seq_len:
            s.chunked = None
            s._prefill_done(req)  # sampled this pass, decodes from the next
        return True

    def add_catch_up(self) -> None:
        """Running requests several tokens behind (jump-forward) extend them; the others ride along
        with their one decode token."""
        s = self.s
        rest = [r for r in s.running if r not in self.reqs]
        exts = [r.seq_len - r.kv_len for r in rest]
        if not any(ext > 1 for ext in exts):
            return
        if self._take_all(rest, exts):
            return
        for req, ext in zip(rest, exts):  # one by one: the pool is short (or the budget)
            if ext > self.budget:
                break
            if not self._take(req, ext):
                # Out of memory for the catch-up pass: retract the youngest request not in this
                # batch (its work stays in the tree), or nothing could ever move again.
                victims = [r for r in s.running if r not in self.reqs]
                if victims:
                    s._retract(max(victims, key=lambda r: r.arrival_time))
                break

    def reserve_riders(self, riders: list[Req]) -> list[Req]:
        """Mixed chunks: the running requests' decode tokens are taken out of the round's budget before
        anything else (add_riders takes them at the end). Returns the riders reserved for: none where they
        would take half the budget or more."""
        if len(riders) > max_riders(self.budget):
            return []
        self.budget -= len(riders)
        return riders

    def add_riders(self, riders: list[Req]) -> list[Req]:
        """Mixed chunks: the reserved riders not already in the batch (a catch-up pass takes every running
        request) ride along with their one decode token, at the batch's end (the attention backend can run
        them as decode rows). Only where the pass computes prompt tokens: riders alone make a decode pass.
        Returns the riders taken (none where the pool is short: they decode in a pass of their own)."""
        self.budget += len(riders)
        taken = set(map(id, self.reqs))
        running = set(map(id, self.s.running))  # a catch-up pass short of memory may have retracted some
        rows = [r for r in riders if id(r) not in taken and id(r) in running]
        if not rows or not self.reqs:
            return []
        return rows if self._take_all(rows, [1] * len(rows)) else []

    def _next_tokens_key(self, req: Req, start: int, node) -> tuple | None:
        """What identifies the tokens a request computes next: where its cached prefix ends (the tree
        node and length: one path) and the next INBATCH_SHARE_TOKENS tokens; None when too few are left
        to be worth sharing."""
        if req.seq_len - start < 2 * INBATCH_SHARE_TOKENS:
            return None
        ids = req.input_ids if start + INBATCH_SHARE_TOKENS <= len(req.input_ids) else req.all_ids
        return (req.cache_salt, id(node), start, tuple(ids[start:start + INBATCH_SHARE_TOKENS]))

    def _defer_sibling(self, req: Req, match) -> bool:
        """True when a request already taken this round computes the same next tokens (then this one
        waits a round and hits them); otherwise this request claims them."""
        if not self.s.cache.retains:
            return False  # nothing computed is kept: waiting would not make it a hit
        key = self._next_tokens_key(req, match.length, match.node)
        if key is None:
            return False
        if key in self._shared_keys and req.sibling_deferrals < MAX_SIBLING_DEFERRALS:
            req.sibling_deferrals += 1
            return True
        self._shared_keys.add(key)
        return False

    def add_waiting(self, req: Req) -> bool:
        """Try to admit a queued request. False: stop admitting this round."""
        s = self.s
        if self.budget <= 0 or s.num_running() >= s.config.max_running_requests or s.req_pool.available() == 0:
            return False
        role = req.transfer_role
        if role is not None and self._transfers_wait:
            return True
        if role == "prefill" and not self._budget_fits(s.prefill_stages.budget, req, len(req.input_ids)):
            return True
        # Matched here, right before locking: an eviction earlier in this round may have shortened what
        # the ordering saw.
        match = s._admission_match(req)
        if match is None:
            return True  # its prefix is on the way back from the host tier
        if self._defer_sibling(req, match):
            return True
        s.cache.lock(match.node)  # first: neither the checks nor an eviction may count it as free
        s.drop_host_load(req)
        if role == "decode":
            return self._reserve_for_transfer(req, match)
        ext_total = req.seq_len - match.length
        ext = chunk_len(ext_total, s.config.chunked_prefill_size, self.budget)
        if not self.fits(req, ext) or (ext < ext_total and ext < s.page_size):
            s.cache.unlock(match.node)
            return False
        s._bind(req, match)
        if not self._take(req, ext):
            # Not even the first chunk fits: undo and stop admitting.
            s._unbind(req)
            self._cannot_fit(req)
            return False
        s._mark_admitted(req, match.length)
        self.reserve += s._reserve_of(req)
        self.admitted += 1
        if ext < ext_total:
            s.chunked = req
            return False
        s._prefill_done(req)
        return True

    def _budget_fits(self, budget, req: Req, tokens: int) -> bool:
        """Whether the transfer's KV buffer fits its side's budget (stages.TransferBudget); if not, it and the
        transfers after it wait for a later round."""
        if budget.fits(req.transfer_id, tokens):
            return True
        self._transfers_wait = True
        return False

    def _cannot_fit(self, req: Req) -> None:
        """Not even `req`'s first pages fit now. Unless something holds KV that comes back without it (it waits then),
        it fails as larger than the whole pool; but first, prefixes the host tier brought back for other queued
        requests are let go (evictable; those requests match again): each stays locked until its request's
        admission, which this round does not reach (it stops here), so `req` would wait for them forever or, as
        before, fail beside KV that is not really in use. It tries again next round."""
        s = self.s
        if self._busy():
            return
        held = [r for r in s.waiting if r is not req and r.host_load is not None]
        for r in held:
            s.drop_host_load(r)
        if not held:
            s.waiting.remove(req)
            s.failed.append(req)  # larger than the whole pool: cannot ever run

    def _reserve_for_transfer(self, req: Req, match) -> bool:
        """Decode side of PD: hold slots for every prompt position the tree lacks (the prefill worker
        sends exactly those) and park the request until they arrive. Nothing is computed here.
        The matched prefix is locked by the caller."""
        s = self.s
        need = req.seq_len - match.length
        if not self._budget_fits(s.decode_stages.budget, req, need):
            s.cache.unlock(match.node)
            return True  # its receive buffer waits for room (and the next transfers behind it)
        if not self.fits(req, need):
            s.cache.unlock(match.node)
            return False
        s._evict_for(need)
        slots = s.allocator.alloc(need, int(match.slots[-1]) if len(match.slots) else -1)
        if slots is None:
            s.cache.unlock(match.node)
            self._cannot_fit(req)
            return False
        s._bind(req, match)
        req.slots.extend(slots.tolist())
        s._mark_admitted(req, match.length)
        s.decode_stages.reserve(req)  # queued -> reserved: the decode side tells the receiver
        self.reserve += s._reserve_of(req)
        self.admitted += 1
        return True

    # ------------------------------------------------------------------ result
    def batch(self) -> ScheduleBatch | None:
        if not self.reqs:
            return None
        input_ids: list[int] = []
        for req, p, e in zip(self.reqs, self.prefix_lens, self.extend_lens):
            input_ids.extend(req.all_ids[p:p + e])
        return ScheduleBatch(ForwardMode.EXTEND, self.reqs, self.prefix_lens, self.extend_lens, self.sample,
                             input_ids, torch.cat(self.locs))
