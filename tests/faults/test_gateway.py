"""Gateway faults with its workers up (gateway and workers as separate processes, registry in a real
Redis): the gateway SIGKILLed under load and started again - while Redis is down, so it serves its
--workers list and picks the registry up later - then a worker and the gateway each drained by SIGTERM
with streams in flight."""
from __future__ import annotations

import signal
import threading
import time

import pytest
import redis
import requests

from tests.support.stack import free_port
from tests.faults.harness import (Load, Proc, assert_no_bad, health, one_request, report, wait_for,
                                  wait_kv_baseline, worker_kv)

pytestmark = pytest.mark.e2e

DRAIN = ("--drain-grace", "0.5", "--drain-timeout", "10")


def start_gateway(port: int, redis_url: str, workers: list[str]) -> Proc:
    gw = Proc("services.gateway", "--model-path", "tiny-random", "--port", str(port), "--redis-url", redis_url,
              "--workers", ",".join(workers), *DRAIN)
    gw.wait_line("gateway ready")
    return gw


@pytest.fixture(scope="module")
def fleet(redis_server):
    redis.Redis.from_url(redis_server.url).flushdb()
    procs = []
    try:
        workers = []
        for wid in ("fw1", "fw2"):
            p = Proc("services.worker", "--model-path", "tiny-random", "--redis-url", redis_server.url,
                     "--worker-id", wid, *DRAIN)
            procs.append(p)
        for p in procs:
            workers.append(p.wait_line("WORKER READY").split()[2])
        port = free_port()
        gateways = [start_gateway(port, redis_server.url, workers)]
        url = f"http://127.0.0.1:{port}"
        wait_for(lambda: health(url)[0] == 200, 60, "gateway healthy")
        one_request(url, "warm up", 4, stream=False)
        yield {"url": url, "port": port, "workers": workers, "procs": procs, "gateways": gateways,
               "baseline": worker_kv(url)}
        procs.extend(gateways)
    finally:
        for p in procs:
            p.stop(signal.SIGKILL)


def test_gateway_sigkill_and_restart_while_redis_is_down(fleet, redis_server):
    url = fleet["url"]
    load = Load(url, clients=4, max_new_tokens=60).start()
    time.sleep(1.5)
    fleet["gateways"][0].stop(signal.SIGKILL)
    t_kill = time.monotonic()
    redis_server.stop()  # the new gateway starts without its registry
    try:
        t_start = time.monotonic()
        gw = start_gateway(fleet["port"], redis_server.url, fleet["workers"])
        fleet["gateways"].append(gw)
        started = time.monotonic() - t_start
        wait_for(lambda: health(url)[0] == 200, 60, "the restarted gateway healthy")
        recovered = time.monotonic() - t_kill
        wait_for(lambda: load.ok_after(t_kill) >= 4, 30, "requests served by the new gateway")
        # The dead gateway's requests were aborted on the workers: KV back at idle (load paused first).
        counts = assert_no_bad(load.stop(), allow=("ok", "error", "dropped", "refused"))
        kv = wait_kv_baseline(url, fleet["baseline"])
    finally:
        redis_server.start()
    r = redis.Redis.from_url(redis_server.url)
    wait_for(lambda: len(r.keys("radixserve:worker:*")) == 2, 20, "workers re-registered")
    time.sleep(2.0)  # discovery rounds: the registry agrees with the --workers list, nothing dropped
    assert {w["address"] for w in requests.get(url + "/server_info", timeout=10).json()["workers"]} \
        == set(fleet["workers"])
    assert one_request(url, "after the registry came back", 4, stream=False).kind == "ok"
    assert "Traceback" not in gw.text()
    report("gateway SIGKILL + restart (Redis down)", recovery_s=recovered, process_start_s=started, kv_settle_s=kv, **counts)
    assert recovered < 30


def streams_in_flight(url: str, n: int, tokens: int) -> tuple[list, list[threading.Thread]]:
    out: list = []
    threads = [threading.Thread(target=lambda i=i: out.append(one_request(url, f"drain me {i}", tokens, True)))
               for i in range(n)]
    for t in threads:
        t.start()
    time.sleep(0.5)
    return out, threads


def test_worker_sigterm_drains(fleet, redis_server):
    url, (w1, _w2) = fleet["url"], fleet["procs"]
    out, threads = streams_in_flight(url, 4, 60)
    t0 = time.monotonic()
    w1.send(signal.SIGTERM)
    r = redis.Redis.from_url(redis_server.url)
    wait_for(lambda: r.get("radixserve:worker:fw1") is None, 5, "the draining worker deregistered")
    # While it drains, new requests go to the other worker only.
    assert all(one_request(url, f"new work {i}", 4, stream=False).kind == "ok" for i in range(4))
    for t in threads:
        t.join(60)
    assert w1.proc.wait(30) == 0
    stopped = time.monotonic() - t0
    assert [o.kind for o in out] == ["ok"] * 4, out
    wait_kv_baseline(url, fleet["baseline"], [fleet["workers"][1]])
    report("worker SIGTERM drain", in_flight=4, stopped_after_s=stopped)


def test_gateway_sigterm_drains(fleet):
    url, gw = fleet["url"], fleet["gateways"][-1]
    out, threads = streams_in_flight(url, 3, 60)
    t0 = time.monotonic()
    gw.send(signal.SIGTERM)
    wait_for(lambda: health(url)[0] == 503, 5, "not ready while draining")
    for t in threads:
        t.join(60)
    assert gw.proc.wait(30) == 0
    assert [o.kind for o in out] == ["ok"] * 3, out
    report("gateway SIGTERM drain", in_flight=3, stopped_after_s=time.monotonic() - t0)
