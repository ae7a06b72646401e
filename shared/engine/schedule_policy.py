"""The scheduling policy: continuous batching with a radix prefix cache (the loop that asks it each step
is shared/engine/engine_loop.py).

Each call to `schedule()` returns one batch: a prefill (EXTEND) batch when waiting requests can be
admitted (shared/engine/prefill_adder.py decides which), otherwise a decode batch of every running
request. Admission is cache-aware (longest prefix match first, match lengths kept incrementally so it
stays on for any queue length) with an aging bound; long prompts are prefilled in chunks under a token
budget. A request's computed prompt KV enters the tree as soon as the pass computing it is launched
(each chunk too), locked by the request, so requests sharing its prefix hit it while it still decodes;
its decode tokens join the tree when it ends. When the pool runs dry the cache is evicted first, then
running requests are retracted to the queue (their computed KV kept in the tree, so re-admission mostly
hits the cache).

Prefill/decode disaggregation: requests with a transfer go through the stage queues of
shared/pd/stages.py (PrefillStages, DecodeStages, owned by the engine's PrefillSide and
DecodeSide in shared/pd/sides.py, where the stages are described); the scheduler holds no PD list
and asks the stages what it needs (admissible, reserve, park, holds_kv, remove).
"""
from __future__ import annotations

import time
from dataclasses import dataclass, field

import numpy as np
import torch

from shared.cache.base import PrefixCache
from shared.cache.kv_pool import ReqToTokenPool
from shared.engine.config import EngineConfig
from shared.pd.stages import DecodeStages, PrefillStages
from shared.models.forward_batch import ForwardMode
from shared.engine.prefill_adder import PrefillAdder
from shared.engine.schedule_batch import ScheduleBatch
from shared.engine.request import PENDING_TOKEN, Req, ReqStatus

_RESERVE_CAP = 4096  # per request, future decode tokens counted toward the reservation


@dataclass
class SchedulerStats:
    prompt_tokens: int = 0  # counted at first admission
    cached_tokens: int = 0  # prefix tokens served from the cache at first admission
    retractions: int = 0
    evicted_for_admission: int = 0
    oom_aborts: int = 0
    last_round_admitted: int = 0
    extra: dict = field(default_factory=dict)


class SchedulePolicy:
    def __init__(self, config: EngineConfig, cache: PrefixCache, allocator, req_pool: ReqToTokenPool,
                 max_context_len: int, prefill_stages: PrefillStages | None = None,
                 decode_stages: DecodeStages | None = None):
        """The PD stages are the engine's sides' (fresh ones when not given: the scheduler alone)."""
        self.config = config
        self.cache = cache
        self.allocator = allocator
        self.req_pool = req_pool
        self.page_size = cache.page_size
        self.max_context_len = max_context_len
        self.waiting: list[Req] = []
        self.running: list[Req] = []  # prefill done, decoding
        self.chunked: Req | None = None  # prefill in progress across passes
        # PD mode: requests with a transfer are also in a stage of their side (shared/pd/sides.py).
        self.prefill_stages = prefill_stages if prefill_stages is not None else PrefillStages()
        self.decode_stages = decode_stages if decode_stages is not None else DecodeStages()
        self.new_token_ratio = config.init_new_token_ratio
        self.stats = SchedulerStats()
        self._last_was_prefill = False
        # Mixed chunks: every running request that had a token to make rode in the last prefill pass (none
        # needs a decode pass before the next prefill; the ones it admitted ride in that one).
        self._all_rode = False
        # Requests the engine must finish with an error (e.g. cannot fit the pool at all).
        self.failed: list[Req] = []
        self._extended: list[Req] = []  # the last EXTEND batch: its computed KV enters the tree next round

    # ------------------------------------------------------------------ queue
    def add(self, req: Req) -> None:
        req.status = ReqStatus.WAITING
        self.waiting.append(req)

    def num_running(self) -> int:
        return len(self.running) + (1 if self.chunked else 0) + self.decode_stages.num_holding()

    def is_idle(self) -> bool:
        return (not self.waiting and not self.running and self.chunked is None
                and not self.decode_stages.num_holding() and not self.prefill_stages.holds_kv())

    def find(self, rid: str) -> Req | None:
        for r in (self.waiting + self.running + ([self.chunked] if self.chunked else [])
                  + self.decode_stages.holding()):
            if r.rid == rid:
                return r
        return None

    def remove(self, req: Req) -> None:
        """Take a request out of the scheduler (finish/abort), releasing its KV if it holds any."""
        if req in self.waiting:
            self.waiting.remove(req)
        if req in self.running:
            self.running.remove(req)
        role = req.transfer_role
        if role is not None:  # out of its PD stage too (the side may have taken it out already)
            (self.prefill_stages if role == "prefill" else self.decode_stages).remove(req)
        if self.chunked is req:
            self.chunked = None
        if req.req_pool_idx is not None:
            self._release_kv(req)
        self.drop_host_load(req)
        req.status = ReqStatus.FINISHED

    # ------------------------------------------------------------------ schedule
    def schedule(self) -> ScheduleBatch | None:
        """The next batch. Callers advance each request's kv_len by its extend length once the batch is
        launched (before the next call)."""
        self.cache.poll()  # background copies of the host tier that completed
        self._cache_extended()
        # Interleave: after a prefill pass, give running requests a decode step before the next prefill,
        # so a stream of arrivals cannot stall token generation. Requests that rode along in it (mixed
        # chunks) had theirs.
        if (not (self._last_was_prefill and not self._all_rode and any(map(self._needs_decode, self.running)))
                or any(r.seq_len - r.kv_len > 1 for r in self.running)):
            batch = self._schedule_prefill()
            if batch is not None:
                self._last_was_prefill = True
                self._extended = list(batch.reqs)
                return batch
        self._last_was_prefill = self._all_rode = False
        return self._schedule_decode()

    def _order_waiting(self) -> list[Req]:
        """Admission order: aged requests first (FCFS among them), then the longest cached prefix first
        (LPM), or arrival order under FCFS or when the queue is too long to sort cheaply."""
        # PD decode side: a request is eligible only once offered (DecodeStages.admissible).
        admissible = self.decode_stages.admissible
        ready = [r for r in self.waiting if admissible(r)]
        aged = [r for r in ready if r.skipped_rounds >= self.config.max_skipped_rounds]
        rest = [r for r in ready if r.skipped_rounds < self.config.max_skipped_rounds]
        limit = self.config.lpm_queue_limit
        use_lpm = (self.config.schedule_policy == "lpm" and not self.config.disable_radix_cache
                   and (limit <= 0 or len(self.waiting) <= limit))
        if use_lpm:
            lengths = {id(r): self.lpm_length(r) for r in rest}
            rest.sort(key=lambda r: (-lengths[id(r)], r.arrival_time))
        return aged + rest

    def lpm_length(self, req: Req) -> int:
        """The request's cached prefix length for ordering, re-walked only when the part of the tree
        its last answer depended on changed (RadixCache.match_length)."""
        n = self._match_key_len(req)
        if req.lpm_memo is not None and req.lpm_memo[0] == n:
            length, memo = self.cache.match_length(_LazyKey(req, n), req.cache_salt, req.lpm_memo[1])
        else:
            length, memo = self.cache.match_length(req.all_ids[:n], req.cache_salt, None)
        req.lpm_memo = (n, memo)
        return length

    def _match_key_len(self, req: Req) -> int:
        limit = req.seq_len - 1  # at least one token must be computed to produce logits
        if req.wants_input_logprobs and req.num_cached_tokens is None:
            # Input logprobs need the logits from position logprob_start_len - 1 on.
            limit = min(limit, max(0, req.logprob_start_len - 1))
        return max(0, limit // self.page_size * self.page_size)

    def _match_key(self, req: Req) -> list[int]:
        return req.all_ids[:self._match_key_len(req)]

    def _match(self, req: Req):
        return self.cache.match_prefix(self._match_key(req), namespace=req.cache_salt)

    def _admission_match(self, req: Req):
        """The request's match at admission, or None while it waits for the host tier to bring its prefix back
        (others are admitted meanwhile): a match reaching host-only KV starts that load first. A load that
        cannot start or fails leaves the host part a miss (recomputed)."""
        load = req.host_load
        if load is not None and not self.cache.load_ready(load):
            return None
        match = self._match(req)
        if load is None and match.host is not None and not req.host_load_failed:
            load = req.host_load = self.cache.load_back(match)
            if load is not None:
                if not self.cache.load_ready(load):
                    return None
                match = self._match(req)  # done at once (CPU): the prefix is on the device now
        return match

    def drop_host_load(self, req: Req) -> None:
        """The request no longer waits on its load (its own lock holds the path now, or it left). One whose load
        failed recomputes that prefix even if it waits for room again: a load that outlived the timeout once would
        (its device slots back once its copy ends) mostly do so again, and the request would never run."""
        if req.host_load is not None:
            load, req.host_load = req.host_load, None
            req.host_load_failed = req.host_load_failed or self.cache.load_failed(load)
            self.cache.release_load(load)

    def _bind(self, req: Req, match) -> None:
        """Give an admitted request its row and its cached prefix (locked by the caller)."""
        req.req_pool_idx = self.req_pool.alloc()
        req.table_len = 0  # a new row: nothing of it written yet
        req.last_node = match.node
        req.cached_len = req.kv_len = match.length
        req.slots = match.slots.tolist()

    def _unbind(self, req: Req) -> None:
        self.cache.unlock(req.last_node)
        self.req_pool.free(req.req_pool_idx)
        req.req_pool_idx, req.last_node, req.cached_len, req.kv_len, req.slots = None, None, 0, 0, []
        req.table_len = 0

    # ------------------------------------------------------------------ insert at prefill end
    def _cache_extended(self) -> None:
        """Requests of the last EXTEND batch (launched since): their computed KV goes into the tree."""
        extended, self._extended = self._extended, []
        for req in extended:
            if req.req_pool_idx is not None and not req.finished:
                self.cache_computed(req)

    def cache_extended_apart(self) -> None:
        """Ahead of the next schedule(), the part of its `_cache_extended` that leaves the same tree, slots
        and counts whenever it runs before it: requests whose node is a private leaf (no other request's
        insert, release or lock can reach under it: PrefixCache.is_private_leaf) and without proposals
        (the confirmed part of those grows when their pass is processed). The engine calls this while the
        device runs the batch; the rest waits for schedule()."""
        rest = []
        for req in self._extended:
            if req.req_pool_idx is None or req.finished:
                continue
            if not req.proposed and self.cache.is_private_leaf(req.last_node):
                self.cache_computed(req)
            else:
                rest.append(req)
        self._extended = rest

    def cache_computed(self, req: Req) -> None:
        """Insert the request's computed KV (page-aligned, confirmed tokens only) into the tree while it
        keeps running: the lock moves to the new deepest node, and positions another request put into
        the tree first are switched to the tree's slots (ours freed; same tokens, same KV). Later work
        reading those positions runs after the pass that wrote them (one stream), so this is safe to do
        as soon as that pass is launched."""
        if not self.cache.retains:
            return
        P = self.page_size
        ids = req.all_ids
        n = min(req.kv_len, len(ids) - req.proposed)  # unverified jump-forward proposals stay out
        n -= n % P
        old = req.cached_len
        if n <= old:
            return
        tail = ids[old:n]  # what is new: the tree holds ids[:old] already
        if PENDING_TOKEN in tail:  # a sampled token not on the host yet (overlap): stop before it
            n = old + tail.index(PENDING_TOKEN)
            n -= n % P
            if n <= old:
                return
        # From the request's own node down (not from the root): O(new tokens) a call, however deep its
        # path (a jump-forward request inserts after every catch-up pass).
        returned, node, tree = self.cache.insert_extending(req.last_node, old, ids[:n], req.slots[:n],
                                                           namespace=req.cache_salt)
        req.last_node, req.cached_len = node, n
        if returned > old:
            self.allocator.free(np.asarray(req.slots[old:returned], dtype=np.int64))
            req.slots[old:returned] = tree.tolist()
            self.req_pool.write(req.req_pool_idx, old, tree)  # host slots: staged without blocking

    def _reserve_of(self, req: Req) -> float:
        """Slots set aside for a request's future decode tokens (the one reservation formula)."""
        return min(req.remaining_new_tokens(), _RESERVE_CAP) * self.new_token_ratio

    def _reserved_tokens(self) -> float:
        reqs = self.running + ([self.chunked] if self.chunked else [])
        if self.decode_stages.num_holding():  # PD: requests whose pages are on the way decode here next
            reqs += self.decode_stages.holding()
        return sum(self._reserve_of(r) for r in reqs)

    def _free_tokens(self) -> int:
        return self.allocator.available_size() + self.cache.evictable_size()

    def _evict_for(self, tokens: int) -> None:
        """Admission is about to allocate `tokens` slots: evict from the tree what the allocator lacks."""
        if self.allocator.available_size() < tokens:
            self.stats.evicted_for_admission += self.cache.evict(tokens - self.allocator.available_size())

    def _schedule_prefill(self) -> ScheduleBatch | None:
        adder = PrefillAdder(self)
        # 0. Mixed chunks: the running requests' decode tokens are set aside first (taken at 4).
        eligible = ([r for r in self.running if self._needs_decode(r)] if self.config.enable_mixed_chunk
                    else [])
        riders = adder.reserve_riders([r for r in eligible if r.seq_len - r.kv_len == 1])
        solo_pass = False
        # 1. Continue the chunked request first.
        if self.chunked is not None and not adder.add_chunk(self.chunked):
            self._retract_for(adder.last_need)
            return None
        # 2. Running requests that gained several tokens at once (jump-forward) extend them here, and
        #    every other running request rides along with its one decode token, so none stalls.
        adder.add_catch_up()
        # 3. Admit waiting requests (they join self.running, self.chunked or a PD stage as taken).
        if self.chunked is None and self.waiting:
            for req in self._order_waiting():
                if req.solo and adder.reqs:
                    continue  # suspected of failing a step: it runs alone, in a later round
                solo = req.solo
                if not adder.add_waiting(req):
                    break
                if solo and req in adder.reqs:
                    req.solo = False
                    solo_pass = True
                    break  # nothing joins its pass
        for r in self.waiting:
            if adder.admitted or self.running:
                r.skipped_rounds += 1
        self.stats.last_round_admitted = adder.admitted
        # 4. The riders, after every prompt row: with the batch's end all one-token rows, the backend may
        #    run them with its decode kernel.
        adder.add_riders([] if solo_pass else riders)
        batch = adder.batch()
        if batch is not None:
            rows = set(map(id, batch.reqs))
            self._all_rode = self.config.enable_mixed_chunk and all(id(r) in rows for r in eligible)
        return batch

    def _mark_admitted(self, req: Req, cached: int) -> None:
        """Out of the queue; the first admission counts its prompt and cache hit (re-admissions after a
        retraction do not)."""
        self.waiting.remove(req)
        req.status = ReqStatus.RUNNING
        req.host_load_failed = False  # (re-admitted after a retraction, it may load from the host tier again)
        if req.num_cached_tokens is None:
            req.num_cached_tokens = cached
            req.first_scheduled_time = time.monotonic()
            self.stats.prompt_tokens += len(req.input_ids)
            self.stats.cached_tokens += cached
            if req.transfer_role == "prefill":
                self.prefill_stages.admit(req)

    def _holds_kv(self) -> bool:
        """Some other request, or a copy of the host tier, holds KV that will be freed without this one's help (so
        waiting is safe)."""
        return bool(self.running or self.chunked is not None or self.decode_stages.num_holding()
                    or self.prefill_stages.holds_kv() or self.cache.copies_hold_slots())

    def _holds_kv_besides(self, req: Req) -> bool:
        """Whether a request other than `req` holds KV that will be freed without `req`'s help."""
        return (any(r is not req for r in self.running) or self.chunked is not None
                or bool(self.decode_stages.num_holding()) or self.prefill_stages.holds_kv())

    def _prefill_done(self, req: Req) -> None:
        if req.transfer_role == "prefill":
            self.prefill_stages.park(req)  # never decodes here
        else:
            self.running.append(req)

    def kv_arrived(self, req: Req) -> None:
        """Decode side: the request's prompt KV is complete (DecodeSide took it out of its stages); it
        decodes from the next step."""
        req.kv_len = len(req.input_ids)
        self.running.append(req)
        self.cache_computed(req)  # the received prompt serves later requests on this worker too

    def _needs_decode(self, req: Req) -> bool:
        """Whether a running request has a token left to compute. With overlap the tokens of the pass in
        flight are placeholders in output_ids: a request whose placeholder is its last allowed token (by
        max_new_tokens or the context) ends when that pass is processed, whatever the token, so a decode row
        for it would be computed and thrown away."""
        return req.remaining_new_tokens() > 0 and req.seq_len < self.max_context_len

    def _schedule_decode(self) -> ScheduleBatch | None:
        if not self.running or any(r.seq_len - r.kv_len > 1 for r in self.running):
            return None  # a jump-forward extend goes first (prefill path); decode resumes after it
        reqs = [r for r in self.running if self._needs_decode(r)]
        if not reqs:
            return None  # every running request ends with the pass in flight
        self.new_token_ratio = max(self.config.min_new_token_ratio,
                                   self.new_token_ratio - self.config.new_token_ratio_decay)
        while True:
            need = self._decode_slots_needed(reqs)
            if self.allocator.available_size() < need:
                self.cache.evict(need - self.allocator.available_size())
            if self.allocator.available_size() >= need:
                break
            if len(reqs) == 1:
                victim = reqs[0]
                if self._holds_kv_besides(victim):
                    # Others' KV comes back without its help (a PD transfer's reserved slots, a chunked
                    # prompt): it fits alone, so it waits in the queue, its work kept in the tree.
                    self._retract(victim)
                    return None
                self.remove(victim)
                self.stats.oom_aborts += 1
                self.failed.append(victim)
                return None
            victim = self._pick_victim(reqs)
            self._retract(victim)
            reqs.remove(victim)
        locs = self.allocator.alloc_next([req.slots[-1] if req.slots else -1 for req in reqs])
        assert locs is not None
        for req, slot in zip(reqs, locs.tolist()):
            req.slots.append(slot)
        prefix_lens = [req.kv_len for req in reqs]
        input_ids = [req.output_ids[-1] if req.output_ids else req.input_ids[-1] for req in reqs]
        n = len(reqs)
        groups = None
        if not self.config.disable_shared_prefix_attention and n >= 2:
            groups = self.cache.shared_prefix_groups([r.last_node for r in reqs])
        return ScheduleBatch(ForwardMode.DECODE, reqs, prefix_lens, [1] * n, [True] * n, input_ids, locs,
                             prefix_groups=groups)

    def _decode_slots_needed(self, reqs: list[Req]) -> int:
        if self.page_size == 1:
            return len(reqs)
        # Only requests whose last slot ends a page need a fresh page.
        return sum(self.page_size for r in reqs if (r.slots[-1] + 1) % self.page_size == 0)

    # ------------------------------------------------------------------ retraction
    def _pick_victim(self, reqs: list[Req]) -> Req:
        # The youngest request loses least work and lets older ones finish.
        return max(reqs, key=lambda r: r.arrival_time)

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
        if req in self.running:
            self.running.remove(req)
        if req.transfer_role == "prefill":
            self.prefill_stages.unpark(req)
        if self.chunked is req:
            self.chunked = None
        req.kv_len = min(req.kv_len, max(kv_len, req.cached_len))  # what the tree holds is kept
        if req.req_pool_idx is not None:
            self._release_kv(req)
        if req not in self.waiting:
            req.status = ReqStatus.WAITING
            self.waiting.insert(0, req)

    def _retract_for(self, tokens: int) -> None:
        """The chunked request cannot get its next chunk: retract others until it can (or give up)."""
        while self.running and self._free_tokens() < tokens:
            self._retract(self._pick_victim(self.running))

    def truncate_kv(self, req: Req, kv_len: int) -> None:
        """Forget KV past kv_len (rejected proposals): free the pages wholly beyond it; slots left in
        the last kept page stay the request's and are handed out again by the next allocation."""
        assert kv_len >= req.cached_len, "rollback into KV the tree owns"
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
        slots = req.slots  # host ints: only the parts freed become arrays (the row is hundreds long)
        aligned = kv // self.page_size * self.page_size
        if aligned > 0:
            # From the request's node (its cached part is its path): not a walk down the whole path again.
            returned = self.cache.insert_from(req.last_node, req.cached_len, req.all_ids[:aligned], slots[:aligned],
                                              namespace=req.cache_salt)
            assert returned >= req.cached_len, (returned, req.cached_len)
            if returned > req.cached_len:
                self.allocator.free(np.asarray(slots[req.cached_len:returned], dtype=np.int64))
        if len(slots) > aligned:
            # Partial tail page and any slots allocated beyond the computed KV.
            self.allocator.free(np.asarray(slots[aligned:], dtype=np.int64))
        if req.last_node is not None:
            self.cache.unlock(req.last_node)
        self.req_pool.free(req.req_pool_idx)
        req.req_pool_idx, req.last_node, req.cached_len, req.kv_len, req.slots = None, None, 0, 0, []
        req.table_len = 0


class _LazyKey:
    """A request's match key of known length whose tokens are only built if the cache must walk."""

    __slots__ = ("req", "n")

    def __init__(self, req: Req, n: int):
        self.req, self.n = req, n

    def __len__(self) -> int:
        return self.n

    def __getitem__(self, sl):
        return self.req.all_ids[:self.n][sl]
