"""Several gateway processes on one port (`--gateway-processes N`; why: docs/design.md): whole gateways
accepting on one socket bound here, sharing /metrics (prometheus-client's multiprocess files) and the
supervisor's news of workers (JSON lines on each process's stdin, repeated to a restarted process)."""
from __future__ import annotations

import asyncio
import logging
import os
import shutil
import socket
import sys
import tempfile

from services.supervisor import RestartPolicy, WorkerSlot
from shared import event_loop

log = logging.getLogger("services.gateway.pool")

READY_PREFIX = "GATEWAY READY "


def bind_listener(host: str, port: int, backlog: int = 2048) -> socket.socket:
    """The one listening socket of the pool (port 0: a free one), inheritable by its processes."""
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    sock = socket.socket(family, socket.SOCK_STREAM)
    try:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        sock.bind((host, port))
        sock.listen(backlog)
    except OSError:
        sock.close()
        raise
    sock.set_inheritable(True)
    return sock


class GatewayPool:
    """`count` gateway processes, each `python -m services.gateway <argv>` serving the pool's socket."""

    def __init__(self, argv: list[str], count: int, host: str, port: int, policy: RestartPolicy | None = None):
        self.argv, self.count, self.host = list(argv), count, host
        self.port = port
        self.policy = policy or RestartPolicy()
        self.slots: list[WorkerSlot] = []
        self.sock: socket.socket | None = None
        self.metrics_dir: str | None = None
        self._worker_news: dict[str, dict] = {}  # address -> the last non-"up" message (for restarts)

    async def start(self) -> None:
        """Bind, start every process and wait for each to be ready (a failure stops the others)."""
        self.sock = bind_listener(self.host, self.port)
        self.port = self.sock.getsockname()[1]
        self.metrics_dir = tempfile.mkdtemp(prefix="radixserve-gateway-metrics-")
        env = {**os.environ, "PROMETHEUS_MULTIPROC_DIR": self.metrics_dir}
        fd = self.sock.fileno()
        for i in range(self.count):
            argv = [sys.executable, "-m", "services.gateway", *self.argv, "--port", str(self.port),
                    "--gateway-processes", str(self.count), "--listen-fd", str(fd), "--process-index", str(i)]
            self.slots.append(WorkerSlot(f"gateway-{i}", lambda _port, argv=argv: argv, self.policy,
                                         kind="gateway", ready_prefix=READY_PREFIX, pass_fds=(fd,), env=env,
                                         control=True))
        started = await asyncio.gather(*(s.start() for s in self.slots), return_exceptions=True)
        failed = [e for e in started if isinstance(e, BaseException)]
        if failed:
            await self.stop(5.0)
            raise RuntimeError(f"a gateway process did not start: {failed[0]}")
        for slot in self.slots:
            slot.on_change = self._on_change
            slot.watch()

    def worker_status(self, address: str, status: str | None, **detail) -> None:
        """What the stack's supervisor says about a worker (status None: up again), told to every process."""
        msg = {"worker": address, "status": status, **detail}
        if status is None:
            self._worker_news.pop(address, None)
        else:
            self._worker_news[address] = msg
        for slot in self.slots:
            slot.send(msg)

    async def _on_change(self, slot: WorkerSlot, what: str) -> None:
        if what in ("restarting", "down") and slot.proc is not None:
            from prometheus_client import multiprocess

            multiprocess.mark_process_dead(slot.proc.pid, self.metrics_dir)
        elif what == "up":
            for msg in self._worker_news.values():  # a restarted process knows only its command line
                slot.send(msg)

    async def stop(self, timeout: float) -> None:
        """SIGTERM every process (each drains), SIGKILL after `timeout`; then the socket and metrics files."""
        await asyncio.gather(*(s.stop(timeout) for s in self.slots))
        if self.sock is not None:
            self.sock.close()
            self.sock = None
        if self.metrics_dir is not None:
            shutil.rmtree(self.metrics_dir, ignore_errors=True)
            self.metrics_dir = None


async def serve(args, argv: list[str]) -> int:
    """`python -m services.gateway --gateway-processes N ...`: the pool, until SIGINT/SIGTERM."""
    pool = GatewayPool(argv, args.gateway_processes, args.host, args.port)
    try:
        await pool.start()
    except (OSError, RuntimeError) as e:
        print(f"gateway failed to start: {e}", file=sys.stderr, flush=True)
        return 1
    print(f"gateway ready on http://{args.host}:{pool.port} ({pool.count} processes)", flush=True)
    await event_loop.stop_on_signals().wait()
    await pool.stop(args.drain_timeout + args.drain_grace + 10)
    return 0
