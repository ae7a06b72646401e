"""Continuous batching with a radix prefix cache.

Each call to `schedule()` returns one batch: a prefill (EXTEND) batch when waiting requests can be
admitted, otherwise a decode batch of every running request. Admission is cache-aware (longest prefix
match first) with an FCFS fallback for long queues and an aging bound; long prompts are prefilled in
chunks under a token budget; when the pool runs dry the cache is evicted first, then running requests are
retracted to the queue (their computed KV kept in the tree, so re-admission mostly hits the cache).
"""
from __future__ import annotations

import time
from dataclasses import dataclass, field

import torch

from shared.cache.base import PrefixCache
from shared.cache.kv_pool import ReqToTokenPool
from shared.engine.config import EngineConfig
from shared.engine.forward_batch import ForwardMode
from shared.engine.request import Req, ReqStatus

# Longest prefix of a prompt used to spot requests in one admission round that share a prefix the tree
# does not hold yet: all but one are deferred one round so the prefix is computed once, not N times.
_INBATCH_SHARE_TOKENS = 32
_RESERVE_CAP = 4096  # per request, future decode tokens counted toward the reservation


@dataclass
class ScheduleBatch:
    mode: ForwardMode
    reqs: list[Req]
    prefix_lens: list[int]
    extend_lens: list[int]
    sample: list[bool]  # False: a prefill chunk that stops short of the sequence end (no token sampled)
    input_ids: list[int]
    out_cache_loc: torch.Tensor  # host int64

    @property
    def batch_size(self) -> int:
        return len(self.reqs)


@dataclass
class SchedulerStats:
    prompt_tokens: int = 0  # counted at first admission
    cached_tokens: int = 0  # prefix tokens served from the cache at first admission
    retractions: int = 0
    evicted_for_admission: int = 0
    oom_aborts: int = 0
    last_round_admitted: int = 0
    extra: dict = field(default_factory=dict)


class Scheduler:
    def __init__(self, config: EngineConfig, cache: PrefixCache, allocator, req_pool: ReqToTokenPool,
                 max_context_len: int):
        self.config = config
        self.cache = cache
        self.allocator = allocator
        self.req_pool = req_pool
        self.page_size = cache.page_size
        self.max_context_len = max_context_len
        self.waiting: list[Req] = []
        self.running: list[Req] = []  # prefill done, decoding
        self.chunked: Req | None = None  # prefill in progress across passes
        # PD mode. Decode side: slots reserved for the prompt's uncached part, its pages on the way from a
        # prefill worker (`new_awaiting`: reserved in the last round, for the engine to announce).
        # Prefill side: prompt computed (or being computed in the pass just launched); never decoded here,
        # parked with their KV until the transfer ends (`new_transfers`: admitted in the last round).
        self.awaiting_kv: list[Req] = []
        self.new_awaiting: list[Req] = []
        self.prefilled: list[Req] = []
        self.new_transfers: list[Req] = []
        self.new_token_ratio = config.init_new_token_ratio
        self.stats = SchedulerStats()
        self._last_was_prefill = False
        # Requests the engine must finish with an error (e.g. cannot fit the pool at all).
        self.failed: list[Req] = []

    # ------------------------------------------------------------------ queue
    def add(self, req: Req) -> None:
        req.status = ReqStatus.WAITING
        self.waiting.append(req)

    def num_running(self) -> int:
        return len(self.running) + (1 if self.chunked else 0) + len(self.awaiting_kv)

    def is_idle(self) -> bool:
        return (not self.waiting and not self.running and self.chunked is None and not self.awaiting_kv
                and not self.prefilled)

    def find(self, rid: str) -> Req | None:
        for r in self.waiting + self.running + ([self.chunked] if self.chunked else []) + self.awaiting_kv:
            if r.rid == rid:
                return r
        return None

    def remove(self, req: Req) -> None:
        """Take a request out of the scheduler (finish/abort), releasing its KV if it holds any."""
        if req in self.waiting:
            self.waiting.remove(req)
        if req in self.running:
            self.running.remove(req)
        for pd_list in (self.awaiting_kv, self.new_awaiting, self.prefilled, self.new_transfers):
            if req in pd_list:
                pd_list.remove(req)
        if self.chunked is req:
            self.chunked = None
        if req.req_pool_idx is not None:
            self._release_kv(req)
        req.status = ReqStatus.FINISHED

    # ------------------------------------------------------------------ schedule
    def schedule(self) -> ScheduleBatch | None:
        # Interleave: after a prefill pass, give running requests a decode step before the next prefill,
        # so a stream of arrivals cannot stall token generation.
        if not (self._last_was_prefill and self.running) or any(r.seq_len - r.kv_len > 1 for r in self.running):
            batch = self._schedule_prefill()
            if batch is not None:
                self._last_was_prefill = True
                return batch
        self._last_was_prefill = False
        return self._schedule_decode()

    def _order_waiting(self) -> list[Req]:
        """Admission order: aged requests first (FCFS among them), then the longest cached prefix first
        (LPM), or arrival order under FCFS or when the queue is too long to sort cheaply."""
        # Decode side of PD: a request is eligible only once its prefill worker has committed KV to it,
        # so slots are never held for prompts the prefill side cannot start (the two pools would wait
        # on each other).
        ready = [r for r in self.waiting if r.transfer_role != "decode" or r.kv_offered]
        aged = [r for r in ready if r.skipped_rounds >= self.config.max_skipped_rounds]
        rest = [r for r in ready if r.skipped_rounds < self.config.max_skipped_rounds]
        use_lpm = (self.config.schedule_policy == "lpm" and not self.config.disable_radix_cache
                   and len(self.waiting) <= self.config.lpm_queue_limit)
        if use_lpm:
            lengths = {id(r): self._match(r).length for r in rest}
            rest.sort(key=lambda r: (-lengths[id(r)], r.arrival_time))
        return aged + rest

    def _match_key(self, req: Req) -> list[int]:
        ids = req.all_ids
        limit = len(ids) - 1  # at least one token must be computed to produce logits
        if req.wants_input_logprobs and req.num_cached_tokens is None:
            # Input logprobs need the logits from position logprob_start_len - 1 on.
            limit = min(limit, max(0, req.logprob_start_len - 1))
        limit = limit // self.page_size * self.page_size
        return ids[:max(0, limit)]

    def _match(self, req: Req):
        return self.cache.match_prefix(self._match_key(req), namespace=req.cache_salt)

    def _reserved_tokens(self) -> float:
        reqs = self.running + ([self.chunked] if self.chunked else [])
        return sum(min(r.remaining_new_tokens(), _RESERVE_CAP) for r in reqs) * self.new_token_ratio

    def _free_tokens(self) -> int:
        return self.allocator.available_size() + self.cache.evictable_size()

    def _schedule_prefill(self) -> ScheduleBatch | None:
        budget = self.config.max_prefill_tokens
        reqs, prefix_lens, extend_lens, sample, locs = [], [], [], [], []
        reserve = self._reserved_tokens()

        def take(req: Req, ext: int) -> bool:
            if self.allocator.available_size() < ext:
                self.stats.evicted_for_admission += self.cache.evict(ext - self.allocator.available_size())
            slots = self.allocator.alloc(ext, req.slots[-1] if req.slots else -1)
            if slots is None:
                return False
            reqs.append(req)
            prefix_lens.append(req.kv_len)
            extend_lens.append(ext)
            sample.append(req.kv_len + ext == req.seq_len)
            locs.append(slots)
            req.slots.extend(slots.tolist())
            return True

        # 1. Continue the chunked request first.
        if self.chunked is not None:
            req = self.chunked
            ext = min(req.seq_len - req.kv_len, self.config.chunked_prefill_size, budget)
            if take(req, ext):
                budget -= ext
                if req.kv_len + ext == req.seq_len:
                    self.chunked = None
                    self._prefill_done(req)  # sampled this pass, decodes from the next
            else:
                self._retract_for(ext)
                return None

        # 2. Running requests that gained several tokens at once (jump-forward) extend them here, and
        #    every other running request rides along with its one decode token, so none stalls.
        if any(r.seq_len - r.kv_len > 1 for r in self.running if r not in reqs):
            for req in [r for r in self.running if r not in reqs]:
                ext = req.seq_len - req.kv_len
                if ext > budget:
                    break
                if not take(req, ext):
                    # Out of memory for the catch-up pass: retract the youngest request not in this
                    # batch (its work stays in the tree), or nothing could ever move again.
                    victims = [r for r in self.running if r not in reqs]
                    if victims:
                        self._retract(max(victims, key=lambda r: r.arrival_time))
                    break
                budget -= ext

        # 3. Admit waiting requests.
        admitted = 0
        shared_keys: set[tuple[int, ...]] = set()
        if self.chunked is None and self.waiting:
            for req in self._order_waiting():
                # Admitted requests join self.running (or self.chunked) as they are taken.
                if req.solo and reqs:
                    continue  # suspected of failing a step: it runs alone, in a later round
                if budget <= 0 or self.num_running() >= self.config.max_running_requests:
                    break
                if self.req_pool.available() == 0:
                    break
                # Matched here, right before locking: an eviction earlier in this round may have
                # shortened what the ordering saw.
                match = self._match(req)
                aged = req.skipped_rounds >= self.config.max_skipped_rounds
                if not aged and req.seq_len >= 2 * _INBATCH_SHARE_TOKENS and match.length < _INBATCH_SHARE_TOKENS:
                    key = tuple(req.all_ids[:_INBATCH_SHARE_TOKENS])
                    if key in shared_keys:
                        continue  # another admitted request computes this prefix now; we hit it next round
                    shared_keys.add(key)
                self.cache.lock(match.node)
                if req.transfer_role == "decode":
                    if not self._reserve_for_transfer(req, match, reserve, bool(reqs)):
                        self.cache.unlock(match.node)
                        break
                    reserve += min(req.remaining_new_tokens(), _RESERVE_CAP) * self.new_token_ratio
                    admitted += 1
                    continue
                ext_total = req.seq_len - match.length
                ext = min(ext_total, self.config.chunked_prefill_size, budget)
                own_reserve = min(req.remaining_new_tokens(), _RESERVE_CAP) * self.new_token_ratio
                if self._free_tokens() < ext + reserve + own_reserve and (reqs or self.running):
                    self.cache.unlock(match.node)
                    break
                if ext < ext_total and ext < self.page_size:
                    self.cache.unlock(match.node)
                    break
                row = self.req_pool.alloc()
                req.req_pool_idx = row
                req.last_node = match.node
                req.cached_len = match.length
                req.kv_len = match.length
                req.slots = match.slots.tolist()
                if not take(req, ext):
                    # Not even the first chunk fits: undo and stop admitting.
                    self.cache.unlock(match.node)
                    self.req_pool.free(row)
                    req.req_pool_idx, req.last_node, req.cached_len, req.kv_len, req.slots = None, None, 0, 0, []
                    if not reqs and not self._holds_kv():
                        self.waiting.remove(req)
                        self.failed.append(req)  # larger than the whole pool: cannot ever run
                    break
                self._mark_admitted(req, match.length)
                reserve += own_reserve
                budget -= ext
                admitted += 1
                solo, req.solo = req.solo, False
                if ext < ext_total:
                    self.chunked = req
                    break
                self._prefill_done(req)
                if solo:
                    break
        for r in self.waiting:
            if admitted or self.running:
                r.skipped_rounds += 1
        self.stats.last_round_admitted = admitted
        if not reqs:
            return None
        input_ids = []
        for req, p, e in zip(reqs, prefix_lens, extend_lens):
            input_ids.extend(req.all_ids[p:p + e])
        return ScheduleBatch(ForwardMode.EXTEND, reqs, prefix_lens, extend_lens, sample, input_ids,
                             torch.cat(locs))

    def _mark_admitted(self, req: Req, cached: int) -> None:
        """Out of the queue; the first admission counts its prompt and cache hit (re-admissions after a
        retraction do not)."""
        self.waiting.remove(req)
        req.status = ReqStatus.RUNNING
        if req.num_cached_tokens is None:
            req.num_cached_tokens = cached
            req.first_scheduled_time = time.monotonic()
            self.stats.prompt_tokens += len(req.input_ids)
            self.stats.cached_tokens += cached
            if req.transfer_role == "prefill":
                self.new_transfers.append(req)

    def _holds_kv(self) -> bool:
        """Some other request holds KV that will be freed without this one's help (so waiting is safe)."""
        return bool(self.running or self.chunked is not None or self.awaiting_kv or self.prefilled)

    def _prefill_done(self, req: Req) -> None:
        (self.prefilled if req.transfer_role == "prefill" else self.running).append(req)

    def _reserve_for_transfer(self, req: Req, match, reserve: float, batch_nonempty: bool) -> bool:
        """Decode side of PD: hold slots for every prompt position the tree lacks (the prefill worker
        sends exactly those) and park the request until they arrive. Nothing is computed here."""
        need = req.seq_len - match.length
        own_reserve = min(req.remaining_new_tokens(), _RESERVE_CAP) * self.new_token_ratio
        busy = batch_nonempty or self._holds_kv()
        if self._free_tokens() < need + reserve + own_reserve and busy:
            return False
        if self.allocator.available_size() < need:
            self.stats.evicted_for_admission += self.cache.evict(need - self.allocator.available_size())
        slots = self.allocator.alloc(need, int(match.slots[-1]) if len(match.slots) else -1)
        if slots is None:
            if not busy:
                self.waiting.remove(req)
                self.failed.append(req)  # larger than the whole pool: cannot ever run
            return False
        req.req_pool_idx = self.req_pool.alloc()
        req.last_node = match.node
        req.cached_len = req.kv_len = match.length
        req.slots = match.slots.tolist() + slots.tolist()
        self._mark_admitted(req, match.length)
        self.awaiting_kv.append(req)
        self.new_awaiting.append(req)
        return True

    def kv_arrived(self, req: Req) -> None:
        """Decode side: the request's prompt KV is complete; it decodes from the next step."""
        self.awaiting_kv.remove(req)
        req.kv_len = len(req.input_ids)
        self.running.append(req)

    def _schedule_decode(self) -> ScheduleBatch | None:
        if not self.running or any(r.seq_len - r.kv_len > 1 for r in self.running):
            return None  # a jump-forward extend goes first (prefill path); decode resumes after it
        self.new_token_ratio = max(self.config.min_new_token_ratio,
                                   self.new_token_ratio - self.config.new_token_ratio_decay)
        while True:
            need = self._decode_slots_needed()
            if self.allocator.available_size() < need:
                self.cache.evict(need - self.allocator.available_size())
            if self.allocator.available_size() >= need:
                break
            if len(self.running) == 1:
                victim = self.running[0]
                self.remove(victim)
                self.stats.oom_aborts += 1
                self.failed.append(victim)
                return None
            self._retract(self._pick_victim())
        reqs = list(self.running)
        locs, prefix_lens = [], []
        for req in reqs:
            slots = self.allocator.alloc(1, req.slots[-1] if req.slots else -1)
            assert slots is not None
            req.slots.extend(slots.tolist())
            locs.append(slots)
            prefix_lens.append(req.kv_len)
        input_ids = [req.output_ids[-1] if req.output_ids else req.input_ids[-1] for req in reqs]
        n = len(reqs)
        return ScheduleBatch(ForwardMode.DECODE, reqs, prefix_lens, [1] * n, [True] * n, input_ids,
                             torch.cat(locs))

    def _decode_slots_needed(self) -> int:
        if self.page_size == 1:
            return len(self.running)
        # Only requests whose last slot ends a page need a fresh page.
        return sum(self.page_size for r in self.running if (r.slots[-1] + 1) % self.page_size == 0)

    # ------------------------------------------------------------------ retraction
    def _pick_victim(self) -> Req:
        # The youngest request loses least work and lets older ones finish.
        return max(self.running, key=lambda r: r.arrival_time)

    def _retract(self, req: Req) -> None:
        self.running.remove(req)
        req.drop_proposals()  # re-admission re-derives them; a prefill chunk must not split them
        self._release_kv(req)
        req.status = ReqStatus.WAITING
        req.retractions += 1
        self.stats.retractions += 1
        self.waiting.insert(0, req)
        self.new_token_ratio = min(1.0, self.new_token_ratio + 0.1)

    def requeue(self, req: Req, kv_len: int) -> None:
        """Back to the front of the queue after a failed step: KV past `kv_len` (what the failed pass
        wrote) is not trusted and is freed; the rest goes to the tree, so re-admission mostly hits it."""
        for lst in (self.running, self.prefilled, self.new_transfers):
            if req in lst:
                lst.remove(req)
        if self.chunked is req:
            self.chunked = None
        req.kv_len = min(req.kv_len, kv_len)
        if req.req_pool_idx is not None:
            self._release_kv(req)
        if req not in self.waiting:
            req.status = ReqStatus.WAITING
            self.waiting.insert(0, req)

    def _retract_for(self, tokens: int) -> None:
        """The chunked request cannot get its next chunk: retract others until it can (or give up)."""
        while self.running and self._free_tokens() < tokens:
            self._retract(self._pick_victim())

    def truncate_kv(self, req: Req, kv_len: int) -> None:
        """Forget KV past kv_len (rejected proposals): free the pages wholly beyond it; slots left in
        the last kept page stay the request's and are handed out again by the next allocation."""
        if kv_len >= len(req.slots):
            req.kv_len = min(req.kv_len, kv_len)
            return
        P = self.page_size
        keep_page = req.slots[kv_len - 1] // P if kv_len > 0 else -1
        drop = [s for s in req.slots[kv_len:] if s // P != keep_page]
        if drop:
            self.allocator.free(torch.tensor(drop, dtype=torch.int64))
        req.slots = req.slots[:kv_len]
        req.kv_len = kv_len

    def _release_kv(self, req: Req) -> None:
        """Hand the request's computed KV to the tree and free what the tree does not keep."""
        kv = req.kv_len
        slots = torch.tensor(req.slots, dtype=torch.int64)
        aligned = kv // self.page_size * self.page_size
        if aligned > 0:
            returned = self.cache.insert(req.all_ids[:aligned], slots[:aligned], namespace=req.cache_salt)
            assert returned >= req.cached_len, (returned, req.cached_len)
            if returned > req.cached_len:
                self.allocator.free(slots[req.cached_len:returned])
        if len(slots) > aligned:
            # Partial tail page and any slots allocated beyond the computed KV.
            self.allocator.free(slots[aligned:])
        if req.last_node is not None:
            self.cache.unlock(req.last_node)
        self.req_pool.free(req.req_pool_idx)
        req.req_pool_idx, req.last_node, req.cached_len, req.kv_len, req.slots = None, None, 0, 0, []
