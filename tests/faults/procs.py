"""Real service processes for the fault suite: started with their output drained (so a chatty process
never blocks on a full pipe), stopped by process group."""
from __future__ import annotations

import os
import subprocess
import sys
import threading
import time

import requests

from tests.support.stack import ROOT, free_port, stop_process_group


class Proc:
    def __init__(self, *args: str, ready: str, env: dict | None = None, timeout: float = 120.0):
        full_env = {**os.environ, **(env or {})}
        self.proc = subprocess.Popen([sys.executable, "-m", *args], cwd=ROOT, stdout=subprocess.PIPE,
                                     stderr=subprocess.STDOUT, text=True, start_new_session=True, env=full_env)
        self.lines: list[str] = []
        deadline = time.monotonic() + timeout
        self.ready_line = None
        while time.monotonic() < deadline:
            line = self.proc.stdout.readline()
            if not line:
                break
            self.lines.append(line)
            if line.startswith(ready):
                self.ready_line = line
                break
        if self.ready_line is None:
            self.stop()
            raise RuntimeError(f"{args[0]} did not start:\n" + "".join(self.lines[-40:]))
        threading.Thread(target=self._drain, daemon=True).start()

    def _drain(self) -> None:
        for line in self.proc.stdout:
            self.lines.append(line)

    def alive(self) -> bool:
        return self.proc.poll() is None

    def stop(self) -> None:
        stop_process_group(self.proc)


def worker(*extra: str, env: dict | None = None) -> tuple[Proc, str, int]:
    """A tiny-random worker; returns it with its host and port."""
    p = Proc("services.worker", "--model-path", "tiny-random", *extra, ready="WORKER READY", env=env)
    host, port = p.ready_line.split()[2].rsplit(":", 1)
    return p, host, int(port)


def gateway(workers: str, *extra: str, env: dict | None = None) -> tuple[Proc, str]:
    port = free_port()
    p = Proc("services.gateway", "--model-path", "tiny-random", "--workers", workers, "--port", str(port),
             "--log-level", "warning", *extra, ready="gateway ready", env=env)
    url = f"http://127.0.0.1:{port}"
    wait_healthy(url)
    return p, url


def wait_healthy(url: str, timeout: float = 60.0) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        try:
            if requests.get(url + "/health", timeout=2).status_code == 200:
                return
        except requests.RequestException:
            pass
        time.sleep(0.1)
    raise TimeoutError(f"{url} did not become healthy")
