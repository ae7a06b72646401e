"""Cache-aware routing: send a request where the longest part of its prompt is probably cached already.

With Redis, the workers publish what their radix trees hold (shared/metadata/kv_events.py) and the policy
routes on that exact picture (shared/metadata/kv_index.py), the same in every gateway process: eviction,
other gateways' requests and restarts included. Without it (the embedded stack), or while that picture is
not current for every candidate (Redis away, a resync under way), it routes on what this process sent
where (one log line per switch). Per worker it keeps that approximate prefix index: the prompt cut into
fixed blocks of tokens, each block named by a hash chained over every block before it (so a name stands
for the whole prefix up to it; shared/metadata/kv_events.py's `block_chain`, the workers' naming too),
with a last-used time.
A request walks its own chain and finds, per worker, how many leading blocks that worker has seen. The
worker with the longest match wins unless it is overloaded (more in flight than the least loaded worker
plus a slack); without a worthwhile match the prompt's head picks a home worker by rendezvous hashing
(the prefix-affinity policy), so new prefixes spread evenly and repeat where they landed. Each index is
bounded (least recently used blocks go first), mirroring the eviction on the worker itself.

Whether a pick was right is checked when the request ends: a worker that found a block or more less cached than
the index promised counts as routed on an evicted prefix when the exact index's record of its events dates the
first missing block's removal before the pick (or has none), and as evicted after the pick (the request queued
there; no index could have known) otherwise. `RADIXSERVE_KV_INDEX_ROUTING=0` routes on the approximate index
even while the exact one is current, which then audits it (the ablation bench/kv_routing.py measures).

Unlike hashing a fixed-length head, this keeps a conversation's turns on the worker holding its history
even when every conversation starts with the same system prompt, and spreads the conversations
themselves by load. The salt (tenant) is part of the chain, as it is part of the cache key on workers.
"""
from __future__ import annotations

import logging
import time
from collections import Counter, OrderedDict
from typing import Sequence

from services.gateway.routing.affinity import PrefixAffinityPolicy
from services.gateway.routing.worker_client import WorkerClient
from shared.knobs import knob
from shared.metadata.kv_events import BLOCK_TOKENS, block_chain
from shared.metadata.kv_index import KvIndex

log = logging.getLogger(__name__)

KV_INDEX_ROUTING = knob("KV_INDEX_ROUTING")


_IN_FLIGHT_CHAINS = 8192


class _Index:
    """Block names one worker has been sent, least recently used first (the order is all that is kept)."""

    def __init__(self, capacity: int):
        self.capacity = capacity
        self.blocks: OrderedDict[int, None] = OrderedDict()

    def match(self, chain: list[int]) -> int:
        n = 0
        for name in chain:
            if name not in self.blocks:
                break
            n += 1
        return n

    def insert(self, chain: list[int]) -> None:
        blocks = self.blocks
        move = blocks.move_to_end
        for name in chain:
            if name in blocks:
                move(name)
            else:
                blocks[name] = None
        while len(blocks) > self.capacity:
            blocks.popitem(last=False)


class CacheAwarePolicy:
    def __init__(self, block_tokens: int = BLOCK_TOKENS, slack: int = 4, min_match_blocks: int = 1,
                 blocks_per_worker: int = 1 << 18, exact: KvIndex | None = None):
        self.block_tokens = block_tokens
        self.exact = exact  # the workers' own picture, when they publish it
        self.mode = "approximate"
        # Picks by (index, reason): reason cache (longest match), load (a match, but its worker overloaded),
        # new (no match: prefix affinity). cache_checked: picks for cache reasons whose worker's cached
        # tokens came back; of those, the worker found a block or more less than the index promised:
        # cache_evicted_after when the exact index's record of the worker's events shows the missing block
        # removed after the pick (by the worker's clock: the request queued there, no index could know),
        # else cache_missed (removed before the pick, or no removal known: the index was stale): the
        # rate of routing on an evicted prefix.
        self.decisions: Counter[tuple[str, str]] = Counter()
        self.cache_checked: Counter[str] = Counter()
        self.cache_missed: Counter[str] = Counter()
        self.cache_evicted_after: Counter[str] = Counter()
        self.slack = slack
        self.min_match_blocks = min_match_blocks
        self.blocks_per_worker = blocks_per_worker
        self._index: dict[str, _Index] = {}
        self._fallback = PrefixAffinityPolicy(prefix_tokens=2 * block_tokens, slack=slack)
        # A PD request is routed twice (prefill side, decode side) with the same prompt: hash it once.
        self._last: tuple[Sequence[int], str | None, list[int]] | None = None
        # Chains of prompts in flight, by the prompt list's id (alive while its request is), so that
        # `remember` at the end hashes only the output's blocks; bounded, for requests that never end.
        # [salt, chain, mode, promised tokens, wall time of the pick]
        self._in_flight: OrderedDict[int, list] = OrderedDict()
        # Leading prompt tokens the last pick's worker was already known to hold (before this request).
        self.last_match_tokens = 0

    def pick(self, workers: Sequence[WorkerClient], input_ids: Sequence[int], salt: str | None) -> WorkerClient:
        chain = self._chain(input_ids, salt)
        exact = self.exact
        if exact is not None and KV_INDEX_ROUTING and exact.synced([w.address for w in workers]):
            self._switch("exact")
            # Load: this process's requests, or all the worker said it runs and queues (every gateway's).
            loads = {w.address: max(w.load, exact.queued(w.address)) for w in workers}
            matches = {w.address: exact.match(w.address, chain) for w in workers}
        else:
            if exact is not None:
                self._switch("approximate")
            loads = {w.address: w.load for w in workers}
            matches = {w.address: self._index_of(w).match(chain) for w in workers}
        least = min(loads.values())
        best, best_len = None, 0
        for w in workers:
            n = matches[w.address]
            if n > best_len or (n == best_len and n > 0 and loads[w.address] < loads[best.address]):
                best, best_len = w, n
        if best is not None and best_len >= self.min_match_blocks and loads[best.address] <= least + self.slack:
            chosen, reason = best, "cache"
        else:
            chosen, reason = self._fallback.pick(workers, input_ids, salt), "new" if best is None else "load"
        self.decisions[self.mode, reason] += 1
        self.last_match_tokens = matches[chosen.address] * self.block_tokens
        entry = self._in_flight.get(id(input_ids))
        if entry is not None:
            entry[2:] = [self.mode, self.last_match_tokens if reason == "cache" else 0, time.time()]
        self._index_of(chosen).insert(chain)  # kept warm either way: the fallback
        return chosen

    def _switch(self, mode: str) -> None:
        if mode != self.mode:
            self.mode = mode
            log.warning("cache-aware routing now on the %s index%s", mode,
                        "" if mode == "exact" else " (the workers' KV events are not current)" if KV_INDEX_ROUTING
                        else " ($RADIXSERVE_KV_INDEX_ROUTING=0: the workers' KV events only audit it)")

    def stats(self) -> dict:
        out = {"mode": self.mode,
               "decisions": {f"{m}/{r}": n for (m, r), n in sorted(self.decisions.items())},
               "cache_checked": dict(self.cache_checked), "cache_missed": dict(self.cache_missed),
               "cache_evicted_after": dict(self.cache_evicted_after)}
        if self.exact is not None:
            out["exact_index"] = self.exact.stats()
        return out

    def remember(self, worker: WorkerClient, token_ids: Sequence[int], salt: str | None,
                 prompt: Sequence[int] | None = None, cached_tokens: int | None = None) -> None:
        """A request ended on `worker`, whose tree now holds these tokens (prompt and output): a
        conversation's next turn, which extends them, is then known to match there in full. `prompt`:
        the list the request was routed with, whose chain is reused (token_ids must start with it);
        `cached_tokens`: what the worker found cached of it, checked against what the index promised."""
        entry = self._in_flight.pop(id(prompt), None) if prompt is not None else None
        known = entry[1] if entry is not None and entry[0] == salt else None
        if entry is not None and len(entry) == 5 and entry[3] and cached_tokens is not None:
            self._check(worker, entry, cached_tokens)
        self._index_of(worker).insert(block_chain(token_ids, self.block_tokens, salt, known))

    def _check(self, worker: WorkerClient, entry: list, cached_tokens: int) -> None:
        """Count a cache pick whose worker reported `cached_tokens`: whether it found what was promised and,
        if not, whether the first missing block left the worker before the pick or after."""
        _, chain, mode, promised, picked_at = entry
        self.cache_checked[mode] += 1
        if cached_tokens + self.block_tokens >= promised:
            return
        first_missing = cached_tokens // self.block_tokens
        removed = self.exact.removed_at(worker.address, chain[first_missing]) if self.exact is not None else None
        if removed is not None and removed > picked_at:
            self.cache_evicted_after[mode] += 1
        else:
            self.cache_missed[mode] += 1

    def _chain(self, input_ids: Sequence[int], salt: str | None) -> list[int]:
        last = self._last
        if last is not None and last[0] is input_ids and last[1] == salt:
            return last[2]
        chain = block_chain(input_ids, self.block_tokens, salt)
        self._last = (input_ids, salt, chain)
        self._in_flight[id(input_ids)] = [salt, chain]
        if len(self._in_flight) > _IN_FLIGHT_CHAINS:
            self._in_flight.popitem(last=False)
        return chain

    def forget(self, address: str | None = None) -> None:
        """A worker left or flushed its cache (None: every worker): drop our picture of it."""
        if address is None:
            self._index.clear()
        else:
            self._index.pop(address, None)

    def _index_of(self, w: WorkerClient) -> _Index:
        idx = self._index.get(w.address)
        if idx is None:
            idx = self._index[w.address] = _Index(self.blocks_per_worker)
        return idx
