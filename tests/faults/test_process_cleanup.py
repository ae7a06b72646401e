"""What a process leaves behind when it dies, and what a flood of connections leaves in a worker's log.

A gateway SIGKILLed (no shutdown code runs) takes its helpers with it: the tokenizer pool's processes and
multiprocessing's resource tracker (which exits when the last process holding its pipe is gone). A
worker refusing thousands of unauthenticated connections logs a few lines, with a count, not one each."""
from __future__ import annotations

import os
import signal
import socket
import time

import pytest
import requests

from shared import procfs
from tests.faults.procs import gateway, worker
from tests.support.stack import Stack

pytestmark = pytest.mark.e2e

LONG_PROMPT = "ab " * 6000  # over the gateway's inline limit: tokenized in its pool of processes


def _stack(kind: str):
    """(the process to SIGKILL, its URL, what else to stop afterwards)."""
    if kind == "launch":  # the gateway inside the launcher's process, workers supervised by it
        s = Stack("--workers", "1")
        return s.proc.pid, s.url, [s.stop]
    w, host, port = worker()
    gw, url = gateway(f"{host}:{port}")
    return gw.proc.pid, url, [gw.stop, w.stop]


@pytest.mark.parametrize("kind", ["gateway", "launch"])
def test_sigkilled_gateway_leaves_no_process_running(kind):
    pid, url, stops = _stack(kind)
    helpers: list[int] = []
    try:
        r = requests.post(url + "/v1/completions", json={"model": "tiny-random", "prompt": LONG_PROMPT,
                                                         "max_tokens": 1}, timeout=60)
        assert r.status_code == 400 and "context_length_exceeded" in r.text  # tokenized, then refused
        helpers = procfs.descendants(pid)
        names = " ".join(" ".join(procfs.argv(p)) for p in helpers)
        assert "resource_tracker" in names and "spawn_main" in names, names  # the pool is up
        os.kill(pid, signal.SIGKILL)
        time.sleep(5)
        left = [(p, procfs.argv(p)[-3:]) for p in helpers if procfs.alive(p)]
        assert not left, f"processes outlived the SIGKILLed gateway: {left}"
    finally:
        for p in helpers:
            if procfs.alive(p):
                os.kill(p, signal.SIGKILL)
        for stop in stops:
            stop()


def test_a_flood_of_refused_connections_logs_a_line_a_kind():
    w, host, port = worker("--log-level", "warning")
    try:
        socks = []
        for i in range(1000):  # half idle (the hello times out), half sending garbage
            s = socket.create_connection((host, port))
            if i % 2:
                s.sendall(b"GET / HTTP/1.1\r\nHost: x\r\n\r\n")
            socks.append(s)
        deadline = time.monotonic() + 30
        while time.monotonic() < deadline and sum("refusing a connection" in line for line in w.lines) < 2:
            time.sleep(0.2)
        time.sleep(1)  # every hello has timed out (all 500 within ~a second of the first)
        for s in socks:
            s.close()
        # One line a kind (garbage, hello timed out) for 1,000 refusals; the count that the next window's
        # line carries is tests/worker/test_log_limit.py's (a window is 10 s).
        refusals = [line for line in w.lines if "refusing a connection" in line]
        assert 2 <= len(refusals) <= 4, refusals[:10]
    finally:
        w.stop()
