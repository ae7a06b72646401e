"""Shared fixtures: a real stack (launcher subprocess: gateway + worker processes) on a free port."""
from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import time

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


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
        if self.proc.poll() is None:
            os.killpg(self.proc.pid, signal.SIGTERM)
            try:
                self.proc.wait(20)
            except subprocess.TimeoutExpired:
                os.killpg(self.proc.pid, signal.SIGKILL)
                self.proc.wait()


@pytest.fixture(scope="session")
def stack():
    s = Stack()
    yield s
    s.stop()


@pytest.fixture(scope="session")
def base_url(stack) -> str:
    return stack.url


@pytest.fixture(scope="session")
def pd_stack():
    """Gateway + one prefill and one decode worker process, KV pages over UCX."""
    s = Stack("--topology", "pd")
    yield s
    s.stop()
