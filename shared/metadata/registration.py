"""A worker's entry in the metadata store, refreshed on a beat. A beat that fails (Redis down) is not
an error of the worker: it keeps serving, logs once per outage, retries with backoff, and re-registers
with a fresh entry (load, address) as soon as the store answers again."""
from __future__ import annotations

import asyncio
import logging
from typing import Callable

from shared.metadata.outage import Outage
from shared.metadata.store import WORKER_TTL_S, MetadataStore

log = logging.getLogger(__name__)


class Registration:
    def __init__(self, store: MetadataStore, worker_id: str, entry: Callable[[], dict],
                 ttl_s: float = WORKER_TTL_S, call_timeout_s: float = 3.0):
        self.store = store
        self.worker_id = worker_id
        self.entry = entry
        self.ttl_s = ttl_s
        self.call_timeout_s = call_timeout_s
        self.outage = Outage(f"worker {worker_id} registration", log)

    async def beat(self) -> float:
        """Register (or refresh) now; returns the seconds until the next beat."""
        try:
            async with asyncio.timeout(self.call_timeout_s):
                await self.store.register_worker(self.worker_id, self.entry(), self.ttl_s)
        except Exception as e:  # ConnectionError, TimeoutError, ...: Redis is away, serving goes on
            return self.outage.failed(e)
        self.outage.ok()
        return self.ttl_s / 3

    async def leave(self) -> None:
        """Deregister (best effort: an entry left behind expires after its TTL) and close the store."""
        try:
            async with asyncio.timeout(self.call_timeout_s):
                await self.store.deregister_worker(self.worker_id)
        except Exception as e:
            log.warning("worker %s: could not deregister (%s); the entry expires by itself", self.worker_id, e)
        try:
            await self.store.close()
        except Exception:
            pass
