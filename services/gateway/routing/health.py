"""Readiness: a worker counts once it answered `info` and ran a one-token generate. The gateway reports
healthy after every worker known at start-up did, and from then on while at least one probed worker is
connected. Probing runs in the background, so start-up never blocks on a slow worker."""
from __future__ import annotations

import asyncio
import contextlib
import logging
import uuid
from contextlib import aclosing
from typing import TYPE_CHECKING, Callable

from services.gateway.http.errors import WorkerUnavailable
from services.gateway.routing.worker_client import WorkerClient
from shared.protocol import GenerateRequest
from shared.sampling_params import SamplingParams

if TYPE_CHECKING:
    from services.gateway.routing.router import Router
    from shared.tokenizer import Tokenizer

log = logging.getLogger(__name__)


class HealthMonitor:
    """Each worker's state as /health and /server_info tell it: probed (ready), pinged (responsive), and what a
    supervisor said of one that is not up. The first context length a worker reports goes to
    `on_context_length` (the gateway's, unless --context-length gave it)."""

    interval = 0.5  # seconds between probe rounds
    probe_timeout = 30.0
    ping_interval = 2.0
    ping_timeout = 5.0

    def __init__(self, router: "Router", tokenizer: "Tokenizer",
                 on_context_length: Callable[[int], None] | None = None):
        self.router, self.on_context_length = router, on_context_length
        self.probe_ids = tokenizer.encode("Hi", add_special_tokens=False)[:1] or [0]  # a one-token prompt
        self._liveness: asyncio.Task | None = None
        self.started_ready = False
        self.probed: set[str] = set()
        self.last_info: dict[str, dict] = {}
        # address -> what a supervisor said about a worker that is not up: {"state": "restarting" | "down", ...}
        self.worker_status: dict[str, dict] = {}
        self._task: asyncio.Task | None = None

    @property
    def healthy(self) -> bool:
        """Workers to serve a request now: a routable one that runs whole requests (unified, or a decode
        worker; prefill workers alone serve nothing). (A draining gateway says so before asking.)"""
        return (self.started_ready
                and any(w.routable and w.role != "prefill" and w.address in self.probed for w in self.router.workers))

    def supervisor_says(self, address: str | None, status: str | None, **detail) -> None:
        """A supervisor's news of a worker: not up (`status` restarting | down), or up again (None). A
        worker back up is dialled at once rather than after the connection's reconnect backoff."""
        if not address:
            return
        if status is not None:
            self.worker_status[address] = {"state": status, **detail}
        else:
            self.worker_status.pop(address, None)
            for w in self.router.workers:
                if w.address == address:
                    w.kick()

    def worker_state(self, worker: WorkerClient) -> str:
        """up | draining | unresponsive | restarting | down | disconnected: what /health and /server_info say."""
        if worker.address in self.worker_status:
            return self.worker_status[worker.address]["state"]
        if not worker.connected:
            return "disconnected"
        if worker.draining:
            return "draining"
        return "up" if worker.responsive else "unresponsive"

    def not_up(self) -> dict[str, str]:
        """address -> state, for every worker that is not up."""
        states = {w.address: self.worker_state(w) for w in self.router.workers}
        return {a: s for a, s in states.items() if s != "up"}

    def start(self) -> None:
        if self._task is None:
            self._task = asyncio.get_running_loop().create_task(self._loop(), name="gateway-health")
            self._liveness = asyncio.get_running_loop().create_task(self._liveness_loop(), name="gateway-liveness")

    async def stop(self) -> None:
        for task in (self._liveness, self._task):
            if task is not None:
                task.cancel()
                with contextlib.suppress(asyncio.CancelledError):
                    await task
        self._liveness = self._task = None

    async def _loop(self) -> None:
        while True:
            workers = self.router.workers
            for w in workers:
                if not w.connected:
                    self.probed.discard(w.address)  # a restarted worker must pass again
            pending = [w for w in workers if w.address not in self.probed]
            if pending:
                await asyncio.gather(*(self.probe(w) for w in pending))
            if workers and all(w.address in self.probed for w in workers):
                if not self.started_ready:
                    log.info("all %d workers answered; gateway is healthy", len(workers))
                self.started_ready = True
            await asyncio.sleep(self.interval)

    async def _liveness_loop(self) -> None:
        """Ping every connected worker; a silent one (SIGSTOP, a wedged host) keeps its TCP connection, so it
        is marked unresponsive (the router avoids it) and its connection dropped (its requests fail now)."""
        while True:
            workers = [w for w in self.router.workers if w.connected]
            await asyncio.gather(*(self._ping(w) for w in workers))
            await asyncio.sleep(self.ping_interval)

    async def _ping(self, worker: WorkerClient) -> None:
        try:
            await worker.ping(self.ping_timeout)
        except WorkerUnavailable as e:
            if worker.connected:
                log.warning("worker %s is unresponsive: %s", worker.address, e)
                worker.responsive = False
                worker.drop_connection(f"worker {worker.address} stopped answering pings")
            return
        if not worker.responsive:
            log.info("worker %s answers again", worker.address)
        worker.responsive = True

    async def probe(self, worker: WorkerClient) -> None:
        try:
            self.remember_info(worker, await worker.info())
            async with asyncio.timeout(self.probe_timeout):
                await self.tiny_generate(worker)
        except (WorkerUnavailable, TimeoutError, RuntimeError) as e:
            log.debug("probe of %s failed: %s", worker.address, e)
            return
        self.probed.add(worker.address)

    def remember_info(self, worker: WorkerClient, info: dict) -> None:
        self.last_info[worker.address] = info
        ctx = info.get("max_context_len")
        if self.on_context_length is not None and isinstance(ctx, int) and ctx > 0:
            self.on_context_length(ctx)

    async def tiny_generate(self, worker: WorkerClient) -> None:
        """One token from a one-token prompt, bypassing metrics: proves the worker's forward pass runs."""
        req = GenerateRequest(rid=f"health-{uuid.uuid4().hex}", input_ids=self.probe_ids,
                              sampling=SamplingParams(max_new_tokens=1, temperature=0.0))
        async with aclosing(worker.generate(req)) as outputs:
            async for out in outputs:
                if out.error:
                    raise RuntimeError(out.error)

    async def poll_infos(self, timeout: float = 2.0) -> list[dict]:
        """Fresh info from every connected worker (for /metrics and /server_info); silent ones are skipped."""
        async def one(w: WorkerClient):
            try:
                async with asyncio.timeout(timeout):
                    info = await w.info()
            except (WorkerUnavailable, TimeoutError):
                return None
            self.remember_info(w, info)
            return info

        workers = [w for w in self.router.workers if w.connected]
        infos = await asyncio.gather(*(one(w) for w in workers))
        return [i for i in infos if i is not None]
