"""Faults on a supervised unified stack (`services.launch --workers 2`, registry in a real Redis): a worker
SIGKILLed under load, Redis stopped and started under load, a storm of clients that hang up, a KV pool
driven to exhaustion, and a SIGTERM of the whole stack with streams in flight. Every accepted request
completes or gets a clear error, KV usage returns to the idle baseline, and recovery is bounded."""
from __future__ import annotations

import concurrent.futures as cf
import re
import signal
import threading
import time
from collections import Counter

import pytest
import redis
import requests

from tests.faults.harness import (FaultStack, Load, all_up, assert_no_bad, health, one_request, report, wait_for,
                                  wait_kv_baseline, worker_kv)

pytestmark = pytest.mark.e2e

POOL_TOKENS = 2048


@pytest.fixture(scope="module")
def stack(redis_server):
    redis.Redis.from_url(redis_server.url).flushdb()
    s = FaultStack("--workers", "2", "--redis-url", redis_server.url, "--max-total-tokens", str(POOL_TOKENS),
                   "--restart-backoff", "0.2", "--log-level", "info")
    yield s
    s.stop(signal.SIGKILL)


@pytest.fixture(scope="module")
def baseline(stack):
    one_request(stack.url, "warm up", 4, stream=False)
    return worker_kv(stack.url)


def test_request_id_reaches_every_log_line(stack, baseline):
    """--log-level reaches the in-process gateway; its access line and the worker's line about the
    request carry the client's X-Request-Id, which comes back as a response header."""
    r = requests.post(stack.url + "/v1/completions", headers={"X-Request-Id": "fault-rid-42"},
                      json={"model": "tiny-random", "prompt": "who am I", "max_tokens": 3}, timeout=30)
    assert r.status_code == 200 and r.headers["X-Request-Id"] == "fault-rid-42"
    made = requests.post(stack.url + "/generate", json={"text": "x", "sampling_params": {"max_new_tokens": 1}},
                         timeout=30).headers["X-Request-Id"]
    assert len(made) == 32  # none given: the gateway makes one
    wait_for(lambda: "request_id=fault-rid-42 POST /v1/completions 200 prompt_tokens=" in stack.text(), 10,
             "the access-log line")
    wait_for(lambda: "[request_id=fault-rid-42] finished" in stack.text(), 10, "the worker's line")
    line = next(l for l in stack.lines if "request_id=fault-rid-42 POST" in l)
    assert "output_tokens=3" in line and "ttft=" in line and "e2e=" in line


def test_worker_sigkill_under_load(stack, baseline):
    load = Load(stack.url, clients=4).start()
    time.sleep(1.5)
    name, victim = stack.busiest("unified")
    t_kill = stack.kill_worker(name)
    wait_for(lambda: not all_up(stack.url), 10, "the gateway to see the worker gone")
    noticed = time.monotonic() - t_kill
    wait_for(lambda: load.ok_after(t_kill) >= 4, 20, "requests served by the surviving worker")
    serving = load.first_ok_after(t_kill)
    code, text = health(stack.url)
    assert code == 200 and f"worker {victim}: restarting" in text, text  # degraded, and says which
    states = {w["address"]: w["state"] for w in requests.get(stack.url + "/server_info", timeout=10).json()["workers"]}
    assert states[victim] == "restarting", states
    wait_for(lambda: all_up(stack.url), 90, "the killed worker restarted and taken back")
    recovered = time.monotonic() - t_kill
    time.sleep(1.0)
    counts = assert_no_bad(load.stop())
    # Only the requests running on the killed worker may fail; everything after goes elsewhere.
    assert counts.get("error", 0) <= load.clients, counts
    kv = wait_kv_baseline(stack.url, baseline)
    report("unified-x2 worker SIGKILL", noticed_s=noticed, first_ok_after_kill_s=serving, full_recovery_s=recovered,
           kv_settle_s=kv, **counts)
    assert recovered < 90  # a restart loads the model again: seconds on a quiet machine, more on a busy one


def test_redis_stop_and_start_under_load(stack, baseline, redis_server):
    r = redis.Redis.from_url(redis_server.url)
    wait_for(lambda: len(r.keys("radixserve:worker:*")) == 2, 10, "both workers registered")
    log_start = stack.count
    load = Load(stack.url, clients=4).start()
    time.sleep(1.0)
    redis_server.stop()
    t_stop = time.monotonic()
    time.sleep(5.0)  # longer than a registry beat and several discovery rounds
    assert health(stack.url)[0] == 200
    assert load.ok_after(t_stop + 1.0) > 0, "requests must keep succeeding while Redis is down"
    redis_server.start()
    t_start = time.monotonic()
    wait_for(lambda: len(r.keys("radixserve:worker:*")) == 2, 20, "both workers re-registered")
    reregistered = time.monotonic() - t_start
    time.sleep(1.0)
    counts = assert_no_bad(load.stop(), allow=("ok",))  # Redis is metadata: not one request may fail
    assert {w["address"] for w in requests.get(stack.url + "/server_info", timeout=10).json()["workers"]} \
        == set(stack.workers)
    logs = "".join(stack.since(log_start))
    assert "Traceback" not in logs
    # One line per outage per component (each worker's registration and KV events, the gateway's
    # discovery and KV index), not one per beat or per retry.
    outage_lines = [line for line in logs.splitlines() if "metadata store unreachable" in line]
    assert outage_lines, logs
    per_component = Counter(re.sub(r"\d{4}-\d\d-\d\d [\d:,]+ ", "", line.split("metadata store unreachable")[0])
                            for line in outage_lines)  # the process tag and the component's own words
    assert max(per_component.values()) == 1, per_component
    kv = wait_kv_baseline(stack.url, baseline)
    report("redis stop/start", redis_down_s=t_start - t_stop, reregistered_after_start_s=reregistered,
           kv_settle_s=kv, **counts)
    assert reregistered < 15


def test_client_disconnect_storm(stack, baseline):
    def hang_up(i: int) -> None:
        body = {"model": "tiny-random", "prompt": f"storm {i} " * 20, "max_tokens": 400, "stream": i % 2 == 0}
        try:
            with requests.post(stack.url + "/v1/completions", json=body, stream=True, timeout=(5, 0.3)) as r:
                if i % 2 == 0:
                    next(r.iter_lines())  # the first event, then the connection is closed under the stream
        except requests.RequestException:
            pass  # the non-streaming half gives up waiting (read timeout) and closes its connection

    with cf.ThreadPoolExecutor(16) as pool:
        list(pool.map(hang_up, range(32)))
    t_end = time.monotonic()
    kv = wait_kv_baseline(stack.url, baseline)
    assert one_request(stack.url, "still there?", 4, stream=False).kind == "ok"
    report("client disconnect storm", clients=32, kv_back_to_baseline_s=time.monotonic() - t_end)
    assert kv < 20


def test_kv_pool_exhaustion(stack, baseline):
    def heavy(i: int) -> tuple[int, dict]:
        body = {"text": f"exhaust {i} " + "word " * 150, "sampling_params": {"max_new_tokens": 120, "ignore_eos": True}}
        r = requests.post(stack.url + "/generate", json=body, timeout=120)
        return r.status_code, r.json()

    t0 = time.monotonic()
    with cf.ThreadPoolExecutor(16) as pool:
        results = list(pool.map(heavy, range(16)))  # ~16 x 420 tokens against two 2048-token pools
        too_big = requests.post(stack.url + "/generate", json={"text": "word " * POOL_TOKENS,
                                                                "sampling_params": {"max_new_tokens": 4}}, timeout=60)
    took = time.monotonic() - t0
    assert all(code == 200 and body["meta_info"]["completion_tokens"] == 120 for code, body in results), \
        [(c, str(b)[:200]) for c, b in results if c != 200][:3]
    assert too_big.status_code == 400 and too_big.json()["error"]["message"], too_big.text
    kv = wait_kv_baseline(stack.url, baseline)
    report("KV pool exhaustion", requests=16, all_done_s=took, kv_settle_s=kv)


def test_sigterm_drains_the_stack(stack):
    """The stack stops only on SIGTERM, and then lets the streams in flight finish."""
    out: list = []
    threads = [threading.Thread(target=lambda i=i: out.append(one_request(stack.url, f"drain {i}", 60, stream=True)))
               for i in range(4)]
    for t in threads:
        t.start()
    time.sleep(0.5)
    t0 = time.monotonic()
    stack.send(signal.SIGTERM)
    wait_for(lambda: health(stack.url)[0] != 200, 5, "not ready while draining")
    for t in threads:
        t.join(60)
    assert stack.proc.wait(60) == 0
    assert [o.kind for o in out] == ["ok"] * 4, out
    report("stack SIGTERM drain", in_flight=4, stopped_after_s=time.monotonic() - t0)
