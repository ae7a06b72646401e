"""Worker discovery through the metadata store (Redis across hosts). The registry only adds workers: an
entry can vanish while its worker serves on (a Redis restarted empty), so a worker leaves routing when
its entry *and* its connection are gone, or when it drains. While Redis is unreachable the gateway routes
on the last known set; workers given with --workers are always kept."""
from __future__ import annotations

import asyncio
import logging

from services.gateway.routing.router import Router
from services.gateway.routing.worker_client import WorkerClient
from shared.metadata.outage import Outage
from shared.metadata.store import MetadataStore

log = logging.getLogger(__name__)
_DRAIN_S = 30.0
_ROLES = ("unified", "prefill", "decode")  # registry entries of any other role are not workers to route to


class WorkerDiscovery:
    interval_s = 1.0  # between two reads of the registry

    def __init__(self, store: MetadataStore, router: Router, internal_key: str | None = None):
        self.store = store
        self.internal_key = internal_key
        self.router = router
        self._clients: dict[str, WorkerClient] = {w.address: w for w in router.workers}
        # Workers given on the command line (--workers) stay whatever the registry says: a supervised
        # worker that is restarting has no live entry, and must not be forgotten for it.
        self._static = dict(self._clients)
        self._task: asyncio.Task | None = None
        self._delay = self.interval_s
        self.outage = Outage("worker discovery", log)

    def start(self) -> None:
        self._task = asyncio.get_running_loop().create_task(self._loop(), name="worker-discovery")

    async def close(self) -> None:
        if self._task is not None:
            self._task.cancel()
        await self.store.close()

    async def refresh_once(self) -> bool:
        """One refresh that never raises; False when the store was unreachable."""
        try:
            async with asyncio.timeout(5.0):
                await self.refresh()
        except Exception as e:
            self._delay = self.outage.failed(e)
            return False
        self.outage.ok()
        self._delay = self.interval_s
        return True

    async def refresh(self) -> None:
        entries = await self.store.list_workers()
        wanted: dict[str, WorkerClient] = dict(self._static)
        # Connected and not draining: alive whatever the registry says now (module docstring).
        wanted.update((a, c) for a, c in self._clients.items() if c.connected and not c.draining)
        for info in entries.values():
            if info.get("role") not in _ROLES:
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
            await self.refresh_once()  # on failure the last known set stays in place
            await asyncio.sleep(min(self._delay, self.interval_s * 2))
