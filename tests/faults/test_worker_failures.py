"""Workers that die or stop for real, under a real gateway: requests end with a clear error instead of
hanging, the gateway routes around a silent worker, and recovers when it comes back."""
from __future__ import annotations

import json
import os
import signal
import time

import pytest
import requests

from tests.support.stack import free_port, kill_groups, spawn, wait_for, wait_line

pytestmark = pytest.mark.e2e


def start_pair():
    worker = spawn("services.worker", "--model-path", "tiny-random")
    addr = wait_line(worker, "WORKER READY").split()[2]
    port = free_port()
    gateway = spawn("services.gateway", "--model-path", "tiny-random", "--workers", addr, "--port", str(port))
    wait_line(gateway, "gateway ready")
    url = f"http://127.0.0.1:{port}"
    wait_for(lambda: requests.get(url + "/health", timeout=5).status_code == 200, 60, "health")
    return worker, gateway, url


def interrupt_stream(url: str, worker, sig: int) -> tuple[list[dict], float]:
    """Start a long stream, send `sig` to the worker after its first event; return the events that
    followed and how long the stream took to end after the signal."""
    body = {"text": "keep going", "stream": True,
            "sampling_params": {"max_new_tokens": 4000, "ignore_eos": True}}
    with requests.post(url + "/generate", json=body, stream=True, timeout=60) as resp:
        lines = resp.iter_lines()
        first = next(line for line in lines if line.startswith(b"data: "))
        assert "text" in json.loads(first[6:])
        os.killpg(worker.pid, sig)
        t0 = time.monotonic()
        rest = [json.loads(line[6:]) for line in lines
                if line.startswith(b"data: ") and line != b"data: [DONE]"]
    return rest, time.monotonic() - t0


def test_worker_killed_mid_stream_ends_the_stream_with_an_error():
    worker, gateway, url = start_pair()
    try:
        rest, waited = interrupt_stream(url, worker, signal.SIGKILL)
        assert waited < 15
        assert "error" in rest[-1] and rest[-1]["error"]["message"], rest[-1]
        r = requests.post(url + "/generate", json={"text": "x", "sampling_params": {"max_new_tokens": 2}}, timeout=30)
        assert r.status_code == 503 and "error" in r.json()
    finally:
        kill_groups(worker, gateway)


def test_stopped_worker_fails_fast_and_recovers_after_sigcont():
    worker, gateway, url = start_pair()
    try:
        rest, waited = interrupt_stream(url, worker, signal.SIGSTOP)  # alive, connected, silent
        assert waited < 20, waited  # the ping timeout, not the 600 s token timeout
        assert "error" in rest[-1], rest[-1]
        wait_for(lambda: requests.get(url + "/health", timeout=5).status_code == 503, 20, "unhealthy")
        os.killpg(worker.pid, signal.SIGCONT)
        wait_for(lambda: requests.get(url + "/health", timeout=5).status_code == 200, 30, "healthy again")
        r = requests.post(url + "/generate", json={"text": "x", "sampling_params": {"max_new_tokens": 2}}, timeout=30)
        assert r.status_code == 200, r.text
    finally:
        if worker.poll() is None:
            os.killpg(worker.pid, signal.SIGCONT)
        kill_groups(worker, gateway)
