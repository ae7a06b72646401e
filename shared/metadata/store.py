"""Routing metadata: which workers exist, their role, address and load.

Two implementations of one small interface: an in-process store (the embedded default) and Redis (for a
multi-host deployment). Values are JSON, never pickle. Worker entries expire unless refreshed, so a
crashed worker disappears from routing by itself.
"""
from __future__ import annotations

import json
import time
from abc import ABC, abstractmethod

WORKER_TTL_S = 10.0


class MetadataStore(ABC):
    @abstractmethod
    async def register_worker(self, worker_id: str, info: dict, ttl_s: float = WORKER_TTL_S) -> None:
        """Create or refresh a worker entry (role, host, port, load...)."""

    @abstractmethod
    async def deregister_worker(self, worker_id: str) -> None: ...

    @abstractmethod
    async def list_workers(self) -> dict[str, dict]:
        """worker_id -> info, live entries only."""

    async def close(self) -> None:
        pass


class MemoryStore(MetadataStore):
    def __init__(self):
        self._workers: dict[str, tuple[float, dict]] = {}

    async def register_worker(self, worker_id, info, ttl_s=WORKER_TTL_S):
        self._workers[worker_id] = (time.monotonic() + ttl_s, dict(info))

    async def deregister_worker(self, worker_id):
        self._workers.pop(worker_id, None)

    async def list_workers(self):
        now = time.monotonic()
        return {k: v for k, (exp, v) in self._workers.items() if exp > now}


class RedisStore(MetadataStore):
    def __init__(self, url: str, prefix: str = "radixserve"):
        import redis.asyncio as aioredis

        # Short socket timeouts: a Redis that is down or stopped must fail a call in a second or two,
        # never hold a registry loop (callers retry with backoff, see shared/metadata/outage.py).
        self._redis = aioredis.from_url(url, decode_responses=True, socket_connect_timeout=1.0,
                                        socket_timeout=2.0)
        self._prefix = prefix

    def _key(self, worker_id: str) -> str:
        return f"{self._prefix}:worker:{worker_id}"

    async def register_worker(self, worker_id, info, ttl_s=WORKER_TTL_S):
        await self._redis.set(self._key(worker_id), json.dumps(info), px=int(ttl_s * 1000))

    async def deregister_worker(self, worker_id):
        await self._redis.delete(self._key(worker_id))

    async def list_workers(self):
        out = {}
        keys = [k async for k in self._redis.scan_iter(match=f"{self._prefix}:worker:*", count=100)]
        if not keys:
            return out
        for key, raw in zip(keys, await self._redis.mget(keys)):
            if raw is None:
                continue  # expired between scan and get
            try:
                info = json.loads(raw)
            except ValueError:
                continue
            if isinstance(info, dict):
                out[key.rsplit(":", 1)[1]] = info
        return out

    async def close(self):
        await self._redis.aclose()


def create_store(redis_url: str | None) -> MetadataStore:
    return RedisStore(redis_url) if redis_url else MemoryStore()
