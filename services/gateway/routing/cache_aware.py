"""Cache-aware routing: send a request where the longest part of its prompt is probably cached already.

The gateway cannot see the workers' radix trees, but it knows what it sent where. Per worker it keeps an
approximate prefix index: the prompt cut into fixed blocks of tokens, each block named by a hash chained
over every block before it (so a name stands for the whole prefix up to it), with a last-used time.
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

import itertools
from collections import OrderedDict
from typing import Sequence

from services.gateway.routing.affinity import PrefixAffinityPolicy
from services.gateway.routing.worker_client import WorkerClient


def block_chain(input_ids: Sequence[int], block: int, salt: str | None,
                known: list[int] | None = None) -> list[int]:
    """Chained names of the prompt's full blocks (about 6 us for 512 tokens). `known`: the names of
    the leading blocks, already computed (a finished request's prompt): only the rest is hashed.

    A name is Python's 64-bit tuple hash of (previous name, the block's ids): several times cheaper than a
    cryptographic digest per block, and as good here - names never leave this process (the salt's string
    hash is even seeded per process), and a collision can only send a request to a worker that turns out
    not to hold its prefix, never change what it computes."""
    names = list(known) if known else []
    h = names[-1] if names else hash(salt or "")
    start = len(names) * block
    ids = iter(input_ids) if not start else itertools.islice(input_ids, start, None)
    append = names.append
    for blk in zip(*(ids,) * block):  # the full blocks' ids as tuples, cut in C (a trailing part is left out)
        h = hash((h, blk))
        append(h)
    return names


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
    def __init__(self, block_tokens: int = 16, slack: int = 4, min_match_blocks: int = 1,
                 blocks_per_worker: int = 1 << 18):
        self.block_tokens = block_tokens
        self.slack = slack
        self.min_match_blocks = min_match_blocks
        self.blocks_per_worker = blocks_per_worker
        self._index: dict[str, _Index] = {}
        self._fallback = PrefixAffinityPolicy(prefix_tokens=2 * block_tokens, slack=slack)
        # A PD request is routed twice (prefill side, decode side) with the same prompt: hash it once.
        self._last: tuple[Sequence[int], str | None, list[int]] | None = None
        # Chains of prompts in flight, by the prompt list's id (alive while its request is), so that
        # `remember` at the end hashes only the output's blocks; bounded, for requests that never end.
        self._in_flight: OrderedDict[int, tuple[str | None, list[int]]] = OrderedDict()
        # Leading prompt tokens the last pick's worker was already known to hold (before this request).
        self.last_match_tokens = 0

    def pick(self, workers: Sequence[WorkerClient], input_ids: Sequence[int], salt: str | None) -> WorkerClient:
        least = min(workers, key=lambda w: w.load)
        chain = self._chain(input_ids, salt)
        best, best_len = least, 0
        for w in workers:
            n = self._index_of(w).match(chain)
            if n > best_len or (n == best_len and n > 0 and w.load < best.load):
                best, best_len = w, n
        if best_len >= self.min_match_blocks and best.load <= least.load + self.slack:
            chosen = best
        else:
            chosen = self._fallback.pick(workers, input_ids, salt)
        self.last_match_tokens = (best_len if chosen is best else self._index_of(chosen).match(chain)) \
            * self.block_tokens
        self._index_of(chosen).insert(chain)
        return chosen

    def remember(self, worker: WorkerClient, token_ids: Sequence[int], salt: str | None,
                 prompt: Sequence[int] | None = None) -> None:
        """A request ended on `worker`, whose tree now holds these tokens (prompt and output): a
        conversation's next turn, which extends them, is then known to match there in full. `prompt`:
        the list the request was routed with, whose chain is reused (token_ids must start with it)."""
        entry = self._in_flight.pop(id(prompt), None) if prompt is not None else None
        known = entry[1] if entry is not None and entry[0] == salt else None
        self._index_of(worker).insert(block_chain(token_ids, self.block_tokens, salt, known))

    def _chain(self, input_ids: Sequence[int], salt: str | None) -> list[int]:
        last = self._last
        if last is not None and last[0] is input_ids and last[1] == salt:
            return last[2]
        chain = block_chain(input_ids, self.block_tokens, salt)
        self._last = (input_ids, salt, chain)
        self._in_flight[id(input_ids)] = (salt, chain)
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
