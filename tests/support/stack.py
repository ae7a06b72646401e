"""Real processes for tests: free ports, a private redis-server, and a stack (launcher subprocess: gateway +
worker processes) on a free port. tests/conftest.py turns them into session fixtures."""
from __future__ import annotations

import collections
import itertools
import os
import random
import shutil
import signal
import socket
import subprocess
import sys
import threading
import time

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


_handed_out: set[int] = set()


def _ephemeral_range() -> tuple[int, int]:
    try:
        with open("/proc/sys/net/ipv4/ip_local_port_range") as f:
            lo, hi = (int(v) for v in f.read().split())
        return lo, hi
    except (OSError, ValueError):
        return 32768, 60999


def free_port() -> int:
    """A port that is free now and stays free until a test's server binds it: drawn below the kernel's
    ephemeral range. A port from bind(0) lies inside that range, so any outgoing connection of the
    stack being started (to Redis, to a worker) could take it as its local port before the server
    binds it; that race failed a CI run with EADDRINUSE."""
    lo, _ = _ephemeral_range()
    top = lo - 1 if lo > 12000 else 32767
    rng = random.Random(os.getpid() ^ time.monotonic_ns())
    for _ in range(500):
        port = rng.randint(10000, top)
        if port in _handed_out:
            continue
        with socket.socket() as s:
            try:
                s.bind(("127.0.0.1", port))
            except OSError:
                continue
        _handed_out.add(port)
        return port
    raise RuntimeError("no free port below the ephemeral range")


def stop_process_group(proc: subprocess.Popen, grace: float = 20.0, sig: int = signal.SIGTERM) -> None:
    """`sig` to the process's group (it was started in a session of its own), SIGKILL after `grace`."""
    if proc.poll() is None:
        os.killpg(proc.pid, sig)
        try:
            proc.wait(grace)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()


OUTPUT_HEAD = 500  # a process's first lines are kept (its start-up, ready line included) ...
OUTPUT_TAIL = 5000  # ... and its last ones; those in between are dropped


class Proc:
    """A service process under test: `python -m ARGS` (or `cmd`) from the repository root in a session of
    its own, stdout and stderr on one pipe that a daemon thread reads to the end, so a chatty process (a
    gateway's access log) never blocks on a full pipe. Its first OUTPUT_HEAD and last OUTPUT_TAIL lines
    are kept. With `ready`, the constructor waits for a line starting with it (`ready_line`) and kills the
    process group if none comes."""

    def __init__(self, *args: str, ready: str | None = None, env: dict | None = None, timeout: float = 120.0,
                 cmd: list[str] | None = None):
        self.cmd = cmd or [sys.executable, "-m", *args]
        self.proc = subprocess.Popen(self.cmd, cwd=ROOT, env={**os.environ, **(env or {})}, stdout=subprocess.PIPE,
                                     stderr=subprocess.STDOUT, text=True, errors="replace", start_new_session=True)
        self._head: list[str] = []
        self._tail: collections.deque[str] = collections.deque(maxlen=OUTPUT_TAIL)
        self.count = 0  # lines read so far, dropped ones included
        self._eof = False
        self._cond = threading.Condition()
        self._reader = threading.Thread(target=self._read, daemon=True)
        self._reader.start()
        self.ready_line = None
        if ready is not None:
            try:
                self.ready_line = self.wait_line(ready, timeout)
            except BaseException:
                self.stop(signal.SIGKILL)
                raise

    def _read(self) -> None:
        with self.proc.stdout as out:
            for line in out:
                with self._cond:
                    if len(self._head) < OUTPUT_HEAD:
                        self._head.append(line)
                    self._tail.append(line)
                    self.count += 1
                    self._cond.notify_all()
        with self._cond:
            self._eof = True
            self._cond.notify_all()

    def _kept(self, start: int) -> list[str]:
        """The kept lines after the first `start` read; the caller holds the lock."""
        first = max(start, len(self._head), self.count - len(self._tail))  # the first one to take from the tail
        newest = list(itertools.islice(reversed(self._tail), max(self.count - first, 0)))
        return self._head[start:] + newest[::-1]

    @property
    def lines(self) -> list[str]:
        """A copy of the kept lines (safe to iterate while the reader appends)."""
        with self._cond:
            return self._kept(0)

    def since(self, n: int) -> list[str]:
        """The kept lines after the first `n` read (`n` from an earlier `count`)."""
        with self._cond:
            return self._kept(n)

    def text(self) -> str:
        return "".join(self.lines)

    def tail(self, n: int = 40) -> str:
        with self._cond:
            return "".join(list(self._tail)[-n:])

    def wait_line(self, prefix: str, timeout: float = 120.0, start: int = 0) -> str:
        """The first kept line (after the first `start` read; by default from the very first) that starts
        with `prefix`, waiting for it up to `timeout` seconds: TimeoutError if none comes, RuntimeError if
        the process closed its output without printing one; both quote the last lines of output."""
        deadline = time.monotonic() + timeout
        with self._cond:
            while True:
                for line in self._kept(start):
                    if line.startswith(prefix):
                        return line
                start = self.count
                if self._eof:
                    break
                left = deadline - time.monotonic()
                if left <= 0:
                    raise TimeoutError(f"{self.name}: no line starting {prefix!r} within {timeout} s; last output:\n"
                                       + "".join(list(self._tail)[-40:]))
                self._cond.wait(left)
        try:
            code = self.proc.wait(5)
        except subprocess.TimeoutExpired:
            code = "none yet"
        raise RuntimeError(f"{self.name} exited (code {code}) before printing {prefix!r}; last output:\n" + self.tail())

    @property
    def name(self) -> str:
        return self.cmd[2] if self.cmd[1:2] == ["-m"] else self.cmd[0]

    @property
    def pid(self) -> int:
        return self.proc.pid

    @property
    def returncode(self) -> int | None:
        return self.proc.returncode

    def poll(self) -> int | None:
        return self.proc.poll()

    def wait(self, timeout: float | None = None) -> int:
        return self.proc.wait(timeout)

    def alive(self) -> bool:
        return self.proc.poll() is None

    def send(self, sig: int) -> None:
        """`sig` to the process's group."""
        if self.proc.poll() is None:
            os.killpg(self.proc.pid, sig)

    def stop(self, sig: int = signal.SIGTERM, grace: float = 30.0) -> int:
        """`sig` to the process's group, SIGKILL after `grace` seconds; its exit code."""
        stop_process_group(self.proc, grace, sig)
        self._reader.join(2)  # the last lines (a process's descendants outside its group may hold the pipe)
        return self.proc.returncode


def spawn(*args: str) -> Proc:
    """`python -m ARGS` as a Proc (output drained; see wait_line)."""
    return Proc(*args)


def wait_line(proc: Proc, prefix: str, timeout: float = 120) -> str:
    """proc.wait_line(prefix, timeout): the first line of its output starting with `prefix`."""
    return proc.wait_line(prefix, timeout)


def kill_groups(*procs: "Proc | subprocess.Popen") -> None:
    """SIGKILL to each process's group (no shutdown code runs), then reap it."""
    for p in procs:
        if p.poll() is None:
            os.killpg(p.pid, signal.SIGKILL)
            p.wait()


def wait_for(pred, timeout: float, what: str, interval: float = 0.1):
    """pred()'s first truthy value within `timeout` seconds, else an AssertionError naming `what`."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        value = pred()
        if value:
            return value
        time.sleep(interval)
    raise AssertionError(f"timed out after {timeout} s waiting for {what}")


class RedisServer:
    """A private redis-server on a free port (tests never touch the machine's own Redis). It can be
    stopped and started again on the same port, which is how outage tests take Redis away."""

    def __init__(self, port: int | None = None):
        if shutil.which("redis-server") is None:
            pytest.skip("redis-server is not installed")
        self.port = port or free_port()
        self.url = f"redis://127.0.0.1:{self.port}/0"
        self.proc: subprocess.Popen | None = None
        self.start()

    def start(self) -> None:
        self.proc = subprocess.Popen(
            ["redis-server", "--bind", "127.0.0.1", "--port", str(self.port), "--save", "",
             "--appendonly", "no", "--protected-mode", "no"],
            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, start_new_session=True)
        deadline = time.monotonic() + 10
        while time.monotonic() < deadline:
            try:
                with socket.create_connection(("127.0.0.1", self.port), timeout=0.2):
                    return
            except OSError:
                time.sleep(0.05)
        raise RuntimeError(f"redis-server did not start on port {self.port}")

    def stop(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait()
        self.proc = None


class Stack(Proc):
    """`services.launch` with a tiny-random model on a free port; `workers` are the addresses from its
    READY line."""

    def __init__(self, *extra: str, timeout: float = 120.0):
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        super().__init__("services.launch", "--model-path", "tiny-random", "--port", str(self.port), *extra,
                         ready="READY ", timeout=timeout)
        self.workers = self.ready_line.split("workers=")[1].strip().split(",")
