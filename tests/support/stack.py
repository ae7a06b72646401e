"""Real processes for tests: free ports, a private redis-server, and a stack (launcher subprocess: gateway +
worker processes) on a free port. tests/conftest.py turns them into session fixtures."""
from __future__ import annotations

import os
import random
import signal
import socket
import subprocess
import sys
import time

import shutil

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


def stop_process_group(proc: subprocess.Popen, grace: float = 20.0) -> None:
    """SIGTERM to the process's group (it was started in a session of its own), SIGKILL after `grace`."""
    if proc.poll() is None:
        os.killpg(proc.pid, signal.SIGTERM)
        try:
            proc.wait(grace)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()


def spawn(*args: str) -> subprocess.Popen:
    """`python -m ARGS` from the repository root in a session of its own, stdout and stderr on one pipe."""
    return subprocess.Popen([sys.executable, "-m", *args], cwd=ROOT, stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, text=True, start_new_session=True)


def wait_line(proc: subprocess.Popen, prefix: str, timeout: float = 120) -> str:
    """The first line of `proc`'s output that starts with `prefix` (the lines before it are read and dropped)."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        line = proc.stdout.readline()
        if not line:
            raise RuntimeError(f"process exited (code {proc.poll()}) before printing {prefix!r}")
        if line.startswith(prefix):
            return line
    raise TimeoutError(prefix)


def kill_groups(*procs: subprocess.Popen) -> None:
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


class Stack:
    def __init__(self, *extra: str, timeout: float = 120.0):
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        cmd = [sys.executable, "-m", "services.launch", "--model-path", "tiny-random", "--port",
               str(self.port), *extra]
        self.proc = subprocess.Popen(cmd, cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                                     text=True, start_new_session=True)
        self.lines: list[str] = []
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            line = self.proc.stdout.readline()
            if not line:
                break
            self.lines.append(line)
            if line.startswith("READY "):
                self.workers = line.split("workers=")[1].strip().split(",")
                return
        self.stop()
        raise RuntimeError("stack did not start:\n" + "".join(self.lines))

    def stop(self) -> None:
        stop_process_group(self.proc)
