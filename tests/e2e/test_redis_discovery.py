"""Workers register in a real Redis; the gateway discovers them there, and a worker killed for real
(SIGKILL: no deregistration) leaves routing once its entry expires, while requests keep succeeding."""
from __future__ import annotations

import json
import os
import signal

import pytest
import redis
import requests

from tests.support.stack import free_port, kill_groups, spawn, wait_for, wait_line

pytestmark = pytest.mark.e2e


def workers_seen(url: str) -> set[str]:
    return {w["address"] for w in requests.get(url + "/server_info", timeout=10).json()["workers"]}


@pytest.fixture
def REDIS_URL(redis_server) -> str:
    """The test's own redis-server (never the machine's), emptied before each test."""
    redis.Redis.from_url(redis_server.url).flushdb()
    return redis_server.url


def redis_gateway(procs: list, REDIS_URL: str) -> str:
    """A gateway that finds its workers in REDIS_URL, healthy; appended to `procs`. Returns its URL."""
    port = free_port()
    url = f"http://127.0.0.1:{port}"
    gw = spawn("services.gateway", "--model-path", "tiny-random", "--redis-url", REDIS_URL, "--port", str(port))
    procs.append(gw)
    wait_line(gw, "gateway ready")
    wait_for(lambda: requests.get(url + "/health", timeout=5).status_code == 200, 60, "health")
    return url


def test_gateway_discovers_workers_and_drops_a_killed_one(REDIS_URL):
    r = redis.Redis.from_url(REDIS_URL)
    procs = []
    try:
        addrs = {}
        for wid in ("w1", "w2"):
            p = spawn("services.worker", "--model-path", "tiny-random", "--redis-url", REDIS_URL,
                      "--worker-id", wid)
            procs.append(p)
            addrs[wid] = wait_line(p, "WORKER READY").split()[2]
        assert sorted(k.decode() for k in r.keys("radixserve:worker:*")) == \
            ["radixserve:worker:w1", "radixserve:worker:w2"]
        url = redis_gateway(procs, REDIS_URL)
        assert workers_seen(url) == set(addrs.values())
        prompts = [f"prompt number {i} " * (i + 1) for i in range(8)]
        for p in prompts:
            assert requests.post(url + "/generate", json={"text": p, "sampling_params": {"max_new_tokens": 2}},
                                 timeout=30).status_code == 200
        # SIGKILL: the entry is not removed, it expires (TTL), and discovery drops the worker.
        os.killpg(procs[0].pid, signal.SIGKILL)
        procs[0].wait()
        wait_for(lambda: workers_seen(url) == {addrs["w2"]}, 30, "the killed worker to leave routing")
        for p in prompts:
            resp = requests.post(url + "/generate", json={"text": p, "sampling_params": {"max_new_tokens": 2}},
                                 timeout=30)
            assert resp.status_code == 200, resp.text
        # SIGTERM: a clean stop deregisters at once.
        os.killpg(procs[1].pid, signal.SIGTERM)
        assert procs[1].wait(20) == 0
        assert r.keys("radixserve:worker:*") == []
        wait_for(lambda: workers_seen(url) == set(), 10, "routing to empty")
        resp = requests.post(url + "/generate", json={"text": "x", "sampling_params": {"max_new_tokens": 2}},
                             timeout=30)
        assert resp.status_code == 503 and "error" in resp.json()
    finally:
        kill_groups(*procs)


def _prefill_transfers(url: str) -> int:
    infos = {w["role"]: w["info"] for w in requests.get(url + "/server_info", timeout=10).json()["workers"]}
    return ((infos.get("prefill") or {}).get("kv_transfer") or {}).get("transfers", 0)


def test_pd_workers_found_through_redis_serve_requests_as_pairs(REDIS_URL):
    """The compose PD profile's shape: prefill and decode workers register their roles (and the decode
    worker its UCX address) in Redis; the gateway finds them there and pairs them."""
    r = redis.Redis.from_url(REDIS_URL)
    procs = []
    try:
        for module, wid in (("services.prefill", "p1"), ("services.decode", "d1")):
            p = spawn(module, "--model-path", "tiny-random", "--redis-url", REDIS_URL, "--worker-id", wid)
            procs.append(p)
            wait_line(p, "WORKER READY")
        entries = {k.decode(): json.loads(r.get(k)) for k in r.keys("radixserve:worker:*")}
        assert entries["radixserve:worker:d1"]["role"] == "decode" and entries["radixserve:worker:d1"]["transfer_port"]
        url = redis_gateway(procs, REDIS_URL)
        for i in range(4):
            body = {"text": f"pair me {i}", "sampling_params": {"max_new_tokens": 4}}
            resp = requests.post(url + "/generate", json=body, timeout=30)
            assert resp.status_code == 200 and resp.json()["meta_info"]["completion_tokens"] == 4, resp.text
        # The prefill worker counts a transfer when the decode side's ack reaches it, which races the
        # answer (the decode side acks, then decodes and answers): the last count may come a moment later.
        wait_for(lambda: _prefill_transfers(url) >= 4, 30, "the prefill worker to count 4 KV transfers")
    finally:
        kill_groups(*procs)
