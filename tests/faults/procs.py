"""Real service processes for the fault suite (tests.support.stack.Proc: output drained, stopped by
process group): a worker, a gateway in front of given workers."""
from __future__ import annotations

import time

import requests

from tests.support.stack import Proc, free_port  # noqa: F401 (the fault tests import Proc from here)


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
