"""A real stack (services.launch in its own process group) for the end-to-end benchmarks."""
from __future__ import annotations

import os
import signal
import subprocess
import sys
import threading
import time
from collections import deque

import requests

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def start_stack(path: str, port: int, *extra: str) -> subprocess.Popen:
    cmd = [sys.executable, "-m", "services.launch", "--model-path", path, "--load-format", "dummy",
           "--context-length", "16384", "--port", str(port), *extra]
    proc = subprocess.Popen(cmd, cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                            start_new_session=True)
    tail: deque = deque(maxlen=200)
    for line in proc.stdout:
        tail.append(line)
        if line.startswith("READY"):
            break
    else:
        raise RuntimeError(f"stack exited with {proc.wait()}:\n" + "".join(tail))
    # Keep reading: a full pipe would block the stack's logging. The tail is there for post-mortems.
    threading.Thread(target=lambda: tail.extend(proc.stdout), daemon=True).start()
    proc.log_tail = tail
    url = f"http://127.0.0.1:{port}"
    deadline = time.monotonic() + 300
    while requests.get(url + "/health", timeout=10).status_code != 200:
        if time.monotonic() > deadline:
            raise TimeoutError("stack never became healthy")
        time.sleep(0.5)
    return proc


def stop_stack(proc: subprocess.Popen) -> None:
    os.killpg(proc.pid, signal.SIGTERM)
    try:
        proc.wait(60)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
