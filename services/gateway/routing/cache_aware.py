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

Unlike hashing a fixed-length head, this keeps a conversation's turns on the worker holding its history
even when every conversation starts with the same system prompt, and spreads the conversations
themselves by load. The salt (tenant) is part of the chain, as it is part of the cache key on workers.
"""
from __future__ import annotations

import logging
from collections import Counter, OrderedDict
from typing import Sequence

from services.gateway.routing.affinity import PrefixAffinityPolicy
from services.gateway.routing.worker_client import WorkerClient
from shared.metadata.kv_events import BLOCK_TOKENS, block_chain
from shared.metadata.kv_index import KvIndex

log = logging.getLogger(__name__)


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
        # new (no match: prefix affinity). cache_checked / cache_missed: picks for cache reasons whose
        # worker then reported fewer cached tokens than the index promised (a block or more): the rate of
        # routing on an evicted prefix.
        self.decisions: Counter[tuple[str, str]] = Counter()
        self.cache_checked: Counter[str] = Counter()
        self.cache_missed: Counter[str] = Counter()
        self.slack = slack
        self.min_match_blocks = min_match_blocks
        self.blocks_per_worker = blocks_per_worker
        self._index: dict[str, _Index] = {}
        self._fallback = PrefixAffinityPolicy(prefix_tokens=2 * block_tokens, slack=slack)
        # A PD request is routed twice (prefill side, decode side) with the same prompt: hash it once.
        self._last: tuple[Sequence[int], str | None, list[int]] | None = None
        # Chains of prompts in flight, by the prompt list's id (alive while its request is), so that
        # `remember` at the end hashes only the output's blocks; bounded, for requests that never end.
        self._in_flight: OrderedDict[int, list] = OrderedDict()  # [salt, chain, mode, promised tokens]
        # Leading prompt tokens the last pick's worker was already known to hold (before this request).
        self.last_match_tokens = 0

    def pick(self, workers: Sequence[WorkerClient], input_ids: Sequence[int], salt: str | None) -> WorkerClient:
        chain = self._chain(input_ids, salt)
        exact = self.exact
        if exact is not None and exact.synced([w.address for w in workers]):
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
            entry[2:] = [self.mode, self.last_match_tokens if reason == "cache" else 0]
        self._index_of(chosen).insert(chain)  # kept warm either way: the fallback
        return chosen

    def _switch(self, mode: str) -> None:
        if mode != self.mode:
            self.mode = mode
            log.warning("cache-aware routing now on the %s index%s", mode,
                        "" if mode == "exact" else " (the workers' KV events are not current)")

    def stats(self) -> dict:
        out = {"mode": self.mode,
               "decisions": {f"{m}/{r}": n for (m, r), n in sorted(self.decisions.items())},
               "cache_checked": dict(self.cache_checked), "cache_missed": dict(self.cache_missed)}
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
        if entry is not None and len(entry) == 4 and entry[3] and cached_tokens is not None:
            self.cache_checked[entry[2]] += 1
            if cached_tokens + self.block_tokens < entry[3]:
                self.cache_missed[entry[2]] += 1
        self._index_of(worker).insert(block_chain(token_ids, self.block_tokens, salt, known))

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
