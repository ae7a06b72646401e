"""Worker supervision for `services.launch`: each worker process lives in a slot that restarts it when it
exits, with backoff, on the same port (so the gateway's connection to that address simply comes back).
Gateway processes sharing one port (services/gateway/pool.py) live in slots too: they print their own
ready line, inherit the listening socket, and take control messages on their stdin.

A slot that restarts more than `max_restarts` times within `window_s` gives up: the worker stays down and
the gateway is told so (its /health and /server_info name it). Nothing a worker does stops the stack;
only `stop()` (the launcher's SIGTERM/SIGINT) does.
"""
from __future__ import annotations

import asyncio
import collections
import json
import logging
import os
import signal
import sys
import time
from dataclasses import dataclass, field
from typing import Awaitable, Callable
from services.output_relay import PrefixedRelay
from shared.parent_death import die_with_parent

log = logging.getLogger("services.supervisor")

_START_TIMEOUT_S = 600.0


@dataclass
class RestartPolicy:
    max_restarts: int = 5  # within window_s; one more exit and the worker stays down
    window_s: float = 60.0
    backoff_s: float = 0.5  # first delay; doubles per restart inside the window
    max_backoff_s: float = 10.0


def _child_setup() -> None:
    """In the child, before exec: a process group of its own (the terminal's Ctrl-C reaches the launcher
    alone, which drains the stack in order), in the launcher's session: a session of its own would also be a
    CPU scheduling group of its own (Linux autogroup), where the worker's event loop shares its engine
    thread's share of the cores and, on a busy host, waits tens of ms behind it and the other services (the
    KV events' lag: bench/kv_routing.py; uvloop's subprocess_exec takes no process_group). Then SIGTERM when
    the launcher dies, however it dies (nothing sent to the launcher's group reaches the child)."""
    os.setpgid(0, 0)
    die_with_parent(signal.SIGTERM)


@dataclass
class WorkerSlot:
    """One supervised worker: `cmd(port)` is its command line (port 0 the first time: a free one)."""
    name: str
    cmd: Callable[[int], list[str]]
    policy: RestartPolicy = field(default_factory=RestartPolicy)
    # Called with (slot, state) on every change: "up", "restarting", "down".
    on_change: Callable[["WorkerSlot", str], Awaitable[None] | None] | None = None
    kind: str = "worker"  # in messages
    ready_prefix: str = "WORKER READY "  # its ready line: this, then host:port
    pass_fds: tuple[int, ...] = ()  # descriptors the process inherits (a gateway's listening socket)
    env: dict[str, str] | None = None  # its environment (None: ours)
    control: bool = False  # a pipe to its stdin, for `send`
    proc: asyncio.subprocess.Process | None = None
    address: str | None = None
    state: str = "starting"
    restarts: int = 0
    last_exit: int | None = None
    _recent: collections.deque = field(default_factory=collections.deque)
    _task: asyncio.Task | None = None
    _stopping: bool = False

    @property
    def port(self) -> int:
        return int(self.address.rsplit(":", 1)[1]) if self.address else 0

    async def start(self) -> str:
        """Start the process and wait for its ready line; returns host:port."""
        # Its progress bars and logs reach our stderr, each line prefixed with the worker's name.
        relay = PrefixedRelay(self.name)
        proc = await asyncio.create_subprocess_exec(*self.cmd(self.port), stdout=asyncio.subprocess.PIPE,
                                                    stderr=relay.write_fd, preexec_fn=_child_setup,
                                                    pass_fds=self.pass_fds, env=self.env,
                                                    stdin=asyncio.subprocess.PIPE if self.control else None)
        relay.child_started()
        self.proc = proc
        try:
            addr = await asyncio.wait_for(self._ready_line(proc), _START_TIMEOUT_S)
        except BaseException:
            if proc.returncode is None:
                proc.kill()
                await proc.wait()
            raise
        asyncio.get_running_loop().create_task(_discard(proc.stdout))
        self.address = addr
        return addr

    async def _ready_line(self, proc: asyncio.subprocess.Process) -> str:
        while True:
            line = await proc.stdout.readline()
            if not line:
                raise RuntimeError(f"{self.kind} {self.name} exited before it was ready (code {await proc.wait()})")
            text = line.decode(errors="replace").strip()
            if text.startswith(self.ready_prefix):
                return text[len(self.ready_prefix):].split()[0]

    def send(self, msg: dict) -> None:
        """A control message (one JSON line on its stdin); dropped while the process is down (a restarted
        one starts from the state its command line gives it)."""
        proc = self.proc
        if not self.control or proc is None or proc.returncode is not None or proc.stdin is None:
            return
        try:
            proc.stdin.write(json.dumps(msg).encode() + b"\n")
        except (BrokenPipeError, ConnectionResetError, RuntimeError):
            pass

    def watch(self) -> None:
        self._task = asyncio.get_running_loop().create_task(self._watch(), name=f"supervise-{self.name}")

    async def _notify(self, state: str) -> None:
        self.state = state
        if self.on_change is not None:
            res = self.on_change(self, state)
            if res is not None:
                await res

    async def _watch(self) -> None:
        """Restart the process when it exits (see the module docstring); `on_change` hears of each turn."""
        await self._notify("up")
        while not self._stopping:
            code = await self.proc.wait()
            if self._stopping:
                return
            self.last_exit = code
            now = time.monotonic()
            while self._recent and now - self._recent[0] > self.policy.window_s:
                self._recent.popleft()
            if len(self._recent) >= self.policy.max_restarts:
                log.error("%s %s (%s) exited with code %s; %d restarts in %.0f s: leaving it down",
                          self.kind, self.name, self.address, code, len(self._recent), self.policy.window_s)
                await self._notify("down")
                return
            delay = min(self.policy.backoff_s * 2 ** len(self._recent), self.policy.max_backoff_s)
            self._recent.append(now)
            log.warning("%s %s (%s) exited with code %s; restarting in %.1f s",
                        self.kind, self.name, self.address, code, delay)
            await self._notify("restarting")
            await asyncio.sleep(delay)
            try:
                await self.start()
            except Exception as e:  # exited before its ready line: counts as one more exit
                log.warning("%s %s failed to restart: %s", self.kind, self.name, e)
                continue
            self.restarts += 1
            log.warning("%s %s is back on %s (restart %d)", self.kind, self.name, self.address, self.restarts)
            await self._notify("up")

    async def stop(self, timeout: float) -> None:
        """SIGTERM (the worker drains), then SIGKILL after `timeout`."""
        self._stopping = True
        if self._task is not None:
            self._task.cancel()
        proc = self.proc
        if proc is None or proc.returncode is not None:
            return
        proc.send_signal(signal.SIGTERM)
        try:
            await asyncio.wait_for(proc.wait(), timeout)
        except asyncio.TimeoutError:
            print(f"{self.kind} {self.name} did not stop in {timeout:.0f} s; killing it", file=sys.stderr, flush=True)
            proc.kill()
            await proc.wait()


async def _discard(stream: asyncio.StreamReader) -> None:
    while await stream.readline():
        pass
