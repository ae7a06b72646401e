"""`--gateway-processes N` (services/gateway/pool.py): several gateway processes on one port, through the
real launcher, a real tiny worker and real processes killed for real. They share the port (both accept
connections), /metrics (any process reports every process's requests), a supervisor's news of workers,
and a killed one is restarted while the other keeps serving, losing no request it did not hold."""
from __future__ import annotations

import json
import os
import re
import signal
import threading
import time
import urllib.request

import pytest

from shared import procfs
from tests.support.stack import Stack, stop_process_group, wait_for

pytestmark = pytest.mark.e2e


@pytest.fixture(scope="module")
def pool_stack():
    s = Stack("--gateway-processes", "2", "--restart-backoff", "0.1")
    yield s
    s.stop()


def _get(url: str, timeout: float = 30.0) -> tuple[int, bytes]:
    # A fresh connection each time (no keep-alive): the kernel hands it to whichever process accepts.
    req = urllib.request.Request(url, headers={"Connection": "close"})
    try:
        with urllib.request.urlopen(req, timeout=timeout) as r:
            return r.status, r.read()
    except urllib.error.HTTPError as e:
        return e.code, e.read()


def _post(url: str, body: dict, timeout: float = 60.0) -> tuple[int, bytes]:
    req = urllib.request.Request(url, data=json.dumps(body).encode(), method="POST",
                                 headers={"Content-Type": "application/json", "Connection": "close"})
    try:
        with urllib.request.urlopen(req, timeout=timeout) as r:
            return r.status, r.read()
    except urllib.error.HTTPError as e:
        return e.code, e.read()


def _process(url: str) -> dict:
    status, body = _get(f"{url}/server_info")
    assert status == 200, body
    return json.loads(body)["gateway_process"]


def _pids(url: str, want: int = 2, tries: int = 200) -> dict[int, int]:
    """index -> pid of the processes answering on the port, until `want` were seen."""
    seen: dict[int, int] = {}
    for _ in range(tries):
        p = _process(url)
        assert p["count"] == 2
        seen[p["index"]] = p["pid"]
        if len(seen) >= want:
            break
    return seen


def _requests_total(url: str) -> float:
    status, body = _get(f"{url}/metrics")
    assert status == 200
    m = re.search(rb'^sglang:num_requests_total\{model_name="tiny-random"\} ([0-9.e+]+)$', body, re.M)
    assert m, body[:2000]
    return float(m.group(1))


def _generate(url: str, n: int = 3) -> dict:
    status, body = _post(f"{url}/generate", {"text": "a pool of gateways", "sampling_params": {
        "max_new_tokens": n, "temperature": 0}})
    assert status == 200, body
    return json.loads(body)


def test_both_processes_accept_on_the_one_port(pool_stack):
    seen = _pids(pool_stack.url)
    assert set(seen) == {0, 1}, f"only {seen} answered 200 fresh connections"
    assert len(set(seen.values())) == 2


def test_metrics_cover_every_process(pool_stack):
    url = pool_stack.url
    before = _requests_total(url)
    outs = [_generate(url) for _ in range(8)]  # fresh connections: spread over both processes
    assert all(o["meta_info"]["completion_tokens"] == 3 for o in outs)
    # Whichever process renders the scrape counts all eight.
    totals = {_requests_total(url) for _ in range(6)}
    assert totals == {before + 8}, totals


def test_worker_news_reaches_every_process(pool_stack):
    """The stack's supervisor restarts a killed worker; both gateway processes hear of it (their
    /server_info says so while it restarts) and serve again once it is back."""
    url = pool_stack.url
    worker_pid = _worker_pid(pool_stack)
    os.kill(worker_pid, signal.SIGKILL)
    told = set()

    def heard():
        info_status, body = _get(f"{url}/server_info")
        info = json.loads(body)
        sup = info["workers"][0]["supervisor"]
        if sup and sup["state"] == "restarting":
            told.add(info["gateway_process"]["index"])
        return told == {0, 1}
    wait_for(heard, 60, "both gateway processes told that the worker is restarting", interval=0.02)
    wait_for(lambda: _post(f"{url}/generate", {"text": "back", "sampling_params": {"max_new_tokens": 2}},
                           timeout=30)[0] == 200, 120, "the restarted worker serving again")
    wait_for(lambda: all(json.loads(_get(f"{url}/server_info")[1])["workers"][0]["supervisor"] is None
                         for _ in range(10)), 30, "both processes told that the worker is back")


def test_a_killed_process_is_restarted_and_the_other_serves_meanwhile(pool_stack):
    url = pool_stack.url
    seen = _pids(url)
    before = _requests_total(url)
    os.kill(seen[1], signal.SIGKILL)
    served, failed = 0, []
    deadline = time.monotonic() + 120
    while time.monotonic() < deadline:
        status, body = _post(f"{url}/generate", {"text": "still here", "sampling_params": {"max_new_tokens": 2}})
        if status == 200:
            served += 1
        else:
            failed.append((status, body[:200]))
        p = _process(url)
        if p["index"] == 1 and p["pid"] != seen[1]:
            break
    else:
        raise AssertionError("process 1 was not restarted within 120 s")
    assert served and not failed, failed  # the survivor took every new connection meanwhile
    # The dead process's requests stay counted; the restarted one adds its own.
    assert _requests_total(url) >= before + served


def test_drain_finishes_streams_in_flight():
    """SIGTERM to the launcher: every gateway process drains; a stream in flight ends with [DONE]."""
    s = Stack("--gateway-processes", "2", "--drain-grace", "0.5")
    try:
        chunks: list[bytes] = []
        done = threading.Event()

        def stream():
            req = urllib.request.Request(f"{s.url}/v1/completions", method="POST", data=json.dumps({
                "model": "tiny-random", "prompt": "drain me", "max_tokens": 300, "stream": True,
                "ignore_eos": True}).encode(), headers={"Content-Type": "application/json"})
            with urllib.request.urlopen(req, timeout=120) as r:
                for line in r:
                    chunks.append(line)
            done.set()
        t = threading.Thread(target=stream, daemon=True)
        t.start()
        wait_for(lambda: len(chunks) > 4, 60, "the stream under way")
        os.killpg(s.proc.pid, signal.SIGTERM)
        assert done.wait(120), "the stream did not end"
        assert chunks[-2:] == [b"data: [DONE]\n", b"\n"] or b"data: [DONE]" in b"".join(chunks[-3:])
        s.proc.wait(60)
        assert s.proc.returncode == 0
    finally:
        stop_process_group(s.proc)


def test_the_gateway_alone_runs_a_pool(tmp_path):
    """`python -m services.gateway --gateway-processes 2` (what docker compose runs): the pool without the
    launcher, in front of a worker it did not start; SIGTERM stops every process of it."""
    from tests.support.stack import Proc, free_port

    env = {"RADIXSERVE_INTERNAL_KEY": "pool-test-key"}
    worker = Proc("services.worker", "--model-path", "tiny-random", env=env, ready="WORKER READY")
    gateway = None
    try:
        port = free_port()
        gateway = Proc("services.gateway", "--model-path", "tiny-random", "--workers", worker.ready_line.split()[2],
                       "--port", str(port), "--gateway-processes", "2", env=env, ready="gateway ready")
        assert "(2 processes)" in gateway.ready_line
        url = f"http://127.0.0.1:{port}"
        assert set(_pids(url)) == {0, 1}
        assert _generate(url)["meta_info"]["completion_tokens"] == 3
        children = procfs.children(gateway.pid)
        assert len([p for p in children if "services.gateway" in procfs.argv(p)]) == 2
        os.killpg(gateway.pid, signal.SIGTERM)
        assert gateway.wait(60) == 0
        assert not any(procfs.alive(p) for p in children)
    finally:
        for p in (gateway, worker):
            if p is not None:
                p.stop()


def _worker_pid(stack: Stack) -> int:
    """The stack's one worker: the launcher's child running services.worker."""
    pids = [p for p in procfs.children(stack.proc.pid) if "services.worker" in procfs.argv(p)]
    assert len(pids) == 1, pids
    return pids[0]
