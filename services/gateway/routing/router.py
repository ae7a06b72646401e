"""Which worker serves a request: the Router holds the workers and asks a routing policy.

Two policies: cache-aware (services/gateway/routing/cache_aware.py, the default) remembers which prompt prefixes
went where and prefers the worker holding the longest one, falling back to prefix affinity
(services/gateway/routing/affinity.py), which keeps requests sharing a prompt head on one worker.
"""
from __future__ import annotations

import asyncio
import logging
from typing import Sequence

from services.gateway.routing.affinity import RoutingPolicy
from services.gateway.routing.cache_aware import CacheAwarePolicy
from services.gateway.http.errors import unavailable
from services.gateway.routing.worker_client import WorkerClient

log = logging.getLogger(__name__)

def kv_compatible(a: WorkerClient, b: WorkerClient) -> bool:
    """Whether PD workers a and b can exchange KV pages: the same format, or one not known (a worker of an older
    build; its receiver still checks the pages' header)."""
    return not a.kv_format or not b.kv_format or a.kv_format == b.kv_format


def _live(workers: list[WorkerClient]) -> list[WorkerClient]:
    """Prefer routable workers (connected, responsive, not draining); if none is, pick anyway so the
    request waits for a reconnection (a supervised worker restarts in seconds)."""
    return ([w for w in workers if w.routable] or [w for w in workers if w.connected and not w.draining]
            or [w for w in workers if w.connected] or workers)


class Router:
    def __init__(self, workers: Sequence[WorkerClient], policy: RoutingPolicy | None = None,
                 pd_bypass_tokens: int = 0):
        self.policy = policy or CacheAwarePolicy()
        # PD short-suffix bypass: a decode worker known to hold all of a prompt but at most this many
        # trailing tokens extends it itself (no prefill worker, no transfer). 0 turns it off.
        self.pd_bypass_tokens = pd_bypass_tokens
        self._workers: list[WorkerClient] = list(workers)
        self._kv_mismatch_seen: set[tuple[str, str]] = set()  # (prefill, decode) KV formats warned of
        for w in self._workers:
            w.on_cache_reset = self.forget_cache

    @property
    def workers(self) -> list[WorkerClient]:
        return list(self._workers)

    def set_workers(self, workers: Sequence[WorkerClient]) -> list[WorkerClient]:
        """Replace the worker set (discovery updates). Returns the clients that left, for the caller to
        close once their in-flight requests finish."""
        new = list(workers)
        kept = {id(w) for w in new}
        gone = [w for w in self._workers if id(w) not in kept]
        self._workers = new
        for w in gone:
            self.forget_cache(w.address)
        for w in new:
            w.on_cache_reset = self.forget_cache
            w.start()
        return gone

    async def wait_connected(self, timeout: float) -> None:
        """Until every worker is connected, its role known (PD pairs need both sides), or `timeout` s:
        what a stack's ready line waits for."""
        loop = asyncio.get_running_loop()
        deadline = loop.time() + timeout
        while not all(w.connected for w in self._workers) and loop.time() < deadline:
            await asyncio.sleep(0.05)

    def pick(self, input_ids: Sequence[int], salt: str | None = None) -> WorkerClient:
        """A worker that serves the whole request: unified, or a decode worker computing it locally.
        Prefill workers only ever take part through `pick_pair`."""
        if not self._workers:
            raise unavailable("no workers are registered")
        whole = [w for w in self._workers if w.role != "prefill"]
        if not whole:
            raise unavailable("no unified or decode workers are registered")
        if not any(w.connected for w in whole) and any(w.connected for w in self._workers):
            # The fleet is up but every worker that could finish the request is gone (all decode
            # workers of a PD fleet dead): fail now rather than wait out a reconnection.
            raise unavailable("no unified or decode worker is reachable")
        if self._solo():
            return whole[0]
        return self.policy.pick(_live(whole), input_ids, salt)

    def pick_pair(self, input_ids: Sequence[int], salt: str | None = None
                  ) -> tuple[WorkerClient | None, WorkerClient] | None:
        """(prefill, decode) for a PD request, or None when the fleet has no such pair up. Each side is
        picked by the routing policy among its own kind: both keep radix trees, and a decode worker that
        holds the prefix also receives fewer pages. (None, decode) is the short-suffix bypass: the
        routing index says the decode worker already holds all but at most `pd_bypass_tokens` of the
        prompt (a conversation's next turn), so it computes that suffix itself."""
        prefill = [w for w in self._workers if w.role == "prefill" and w.connected and not w.draining]
        decode = [w for w in self._workers if w.role == "decode" and w.connected and not w.draining
                  and w.transfer_addr]
        if not prefill or not decode:
            return None
        d = self.policy.pick(_live(decode), input_ids, salt)
        held = getattr(self.policy, "last_match_tokens", 0)
        if self.pd_bypass_tokens > 0 and held > 0 and len(input_ids) - held <= self.pd_bypass_tokens:
            return None, d
        fits = [w for w in prefill if kv_compatible(w, d)]
        if not fits:  # no prefill worker sends pages this decode worker takes: it computes the prompt itself
            self._warn_kv_mismatch(prefill[0], d)
            return None, d
        return self.policy.pick(_live(fits), input_ids, salt), d

    def _warn_kv_mismatch(self, prefill: WorkerClient, decode: WorkerClient) -> None:
        key = (prefill.kv_format, decode.kv_format)
        if key not in self._kv_mismatch_seen:
            self._kv_mismatch_seen.add(key)
            log.warning("no prefill worker's KV pages (%s, e.g. %s) fit decode worker %s's (%s): its requests are "
                        "computed there whole; give the PD pools the same model and --kv-cache-dtype",
                        prefill.kv_format, prefill.address, decode.address, decode.kv_format)

    def pick_side(self, role: str, input_ids: Sequence[int], salt: str | None = None,
                  exclude: set[str] = frozenset(), peer: WorkerClient | None = None) -> WorkerClient | None:
        """A replacement PD worker of `role` (prefill|decode) not in `exclude` whose KV pages fit `peer`'s (the
        other side of the pair, if any), or None."""
        ok = [w for w in self._workers if w.role == role and w.connected and not w.draining
              and w.address not in exclude and (role != "decode" or w.transfer_addr)
              and (peer is None or kv_compatible(w, peer))]
        return self.policy.pick(_live(ok), input_ids, salt) if ok else None

    def remember(self, worker: WorkerClient, token_ids: Sequence[int], salt: str | None = None,
                 prompt: Sequence[int] | None = None, cached_tokens: int | None = None) -> None:
        """`worker` finished a request over these tokens (`prompt`, the ids it was routed with, then its
        output; `cached_tokens`: what it found cached of the prompt): the policy may note that its tree
        holds them."""
        if self.remembers(worker):
            self.policy.remember(worker, token_ids, salt, prompt, cached_tokens)

    def follow_kv_events(self, redis_url: str, internal_key: str) -> None:
        """Route on the workers' own KV events in this Redis (cache-aware policy only): a reader task keeps
        the exact index (shared/metadata/kv_index.py) until `close`. Call inside the event loop."""
        if not isinstance(self.policy, CacheAwarePolicy):
            return
        from shared.metadata.kv_index import KvIndexReader

        self._kv_reader = KvIndexReader(redis_url, internal_key)
        self.policy.exact = self._kv_reader.index
        self._kv_task = asyncio.get_running_loop().create_task(self._kv_reader.run(), name="kv-index")

    async def close(self) -> None:
        task = getattr(self, "_kv_task", None)
        if task is not None:
            self._kv_reader.stop()
            task.cancel()
            await asyncio.wait([task], timeout=2.0)
            await self._kv_reader.close()

    def stats(self) -> dict:
        """Routing decisions by index and reason, and the exact index's state (for /server_info, /metrics)."""
        stats = getattr(self.policy, "stats", None)
        return stats() if stats is not None else {}

    def remembers(self, worker: WorkerClient) -> bool:
        """Whether `remember` notes anything for `worker` (a caller builds the token list only then)."""
        return hasattr(self.policy, "remember") and worker in self._workers and not self._solo()

    def _solo(self) -> bool:
        """One worker that serves requests whole (no PD pair to route, no choice to make): the routing
        index is not kept (~30 µs a request at 256 streams); a worker that joins later starts the index
        from empty, as after a cache flush."""
        workers = self._workers
        return len(workers) == 1 and workers[0].role not in ("prefill", "decode")

    def forget_cache(self, address: str | None = None) -> None:
        """Workers' caches were flushed (or one left): the policy's picture of them is stale."""
        forget = getattr(self.policy, "forget", None)
        if forget is not None:
            forget(address)

    @property
    def load(self) -> int:
        return sum(w.load for w in self._workers)
