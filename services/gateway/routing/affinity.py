"""Prefix affinity: requests that share a prompt head go to one worker, so its radix cache keeps hitting,
while in-flight load stays balanced. The head of the token ids picks a worker by rendezvous hashing
(stable when workers come and go), and that worker wins unless it is busier than the least loaded one by
more than a slack. Also the routing-policy interface every policy meets."""
from __future__ import annotations

import hashlib
from typing import Protocol, Sequence

from services.gateway.routing.worker_client import WorkerClient


class RoutingPolicy(Protocol):
    def pick(self, workers: Sequence[WorkerClient], input_ids: Sequence[int], salt: str | None) -> WorkerClient:
        ...


class PrefixAffinityPolicy:
    def __init__(self, prefix_tokens: int = 32, slack: int = 4):
        self.prefix_tokens = prefix_tokens
        self.slack = slack

    def pick(self, workers: Sequence[WorkerClient], input_ids: Sequence[int], salt: str | None) -> WorkerClient:
        least = min(workers, key=lambda w: w.load)
        if len(workers) == 1:
            return least
        key = prefix_key(input_ids, self.prefix_tokens, salt)
        home = max(workers, key=lambda w: _score(key, w.address))
        return home if home.load <= least.load + self.slack else least


def prefix_key(input_ids: Sequence[int], n: int, salt: str | None) -> bytes:
    head = ",".join(map(str, input_ids[:n]))
    # The salt keeps tenants apart here as in the cache: another tenant's prompts must not steer routing.
    return f"{salt or ''}|{head}".encode()


def _score(key: bytes, address: str) -> bytes:
    return hashlib.blake2b(key + b"@" + address.encode(), digest_size=8).digest()
