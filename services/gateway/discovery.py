"""Worker discovery through the metadata store (Redis in a multi-host deployment).

Workers refresh their entry every few seconds and the entry expires otherwise, so a crashed worker
leaves routing within the TTL; one that stops cleanly deregisters at once. The gateway keeps one
client per address and closes a departed worker's client after its in-flight requests drain.
"""
from __future__ import annotations

import asyncio
import logging

from services.gateway.router import Router
from services.gateway.worker_client import WorkerClient
from shared.metadata.store import MetadataStore

log = logging.getLogger(__name__)
_DRAIN_S = 30.0


class WorkerDiscovery:
    def __init__(self, store: MetadataStore, router: Router, interval_s: float = 1.0,
                 roles: tuple[str, ...] = ("unified", "prefill", "decode"), internal_key: str | None = None):
        self.store = store
        self.internal_key = internal_key
        self.router = router
        self.interval_s = interval_s
        self.roles = roles
        self._clients: dict[str, WorkerClient] = {w.address: w for w in router.workers}
        self._task: asyncio.Task | None = None

    def start(self) -> None:
        self._task = asyncio.get_running_loop().create_task(self._loop(), name="worker-discovery")

    async def close(self) -> None:
        if self._task is not None:
            self._task.cancel()
        await self.store.close()

    async def refresh(self) -> None:
        entries = await self.store.list_workers()
        wanted: dict[str, WorkerClient] = {}
        for info in entries.values():
            if info.get("role") not in self.roles:
                continue
            host, port = info.get("host"), info.get("port")
            if not isinstance(host, str) or not isinstance(port, int):
                continue
            addr = f"{host}:{port}"
            wanted[addr] = self._clients.get(addr) or WorkerClient(host, port, internal_key=self.internal_key)
        if set(wanted) == set(self._clients):
            return
        log.info("workers now: %s", ", ".join(sorted(wanted)) or "none")
        for gone in self.router.set_workers(list(wanted.values())):
            asyncio.get_running_loop().create_task(self._retire(gone))
        self._clients = wanted

    async def _retire(self, client: WorkerClient) -> None:
        deadline = asyncio.get_running_loop().time() + _DRAIN_S
        while client.load and asyncio.get_running_loop().time() < deadline:
            await asyncio.sleep(0.2)
        await client.close()

    async def _loop(self) -> None:
        while True:
            try:
                await self.refresh()
            except Exception as e:  # Redis briefly unreachable: keep the last known set
                log.warning("worker discovery failed: %s", e)
            await asyncio.sleep(self.interval_s)
