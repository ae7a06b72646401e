"""PD edges with real processes (gateway, prefill and decode workers, KV over UCX): a prompt larger than
the KV pool is the client's 400 as in unified mode (not a 503), and with every decode worker dead the
gateway says so on /health and fails requests at once instead of waiting out a reconnection."""
from __future__ import annotations

import os
import signal
import time

import pytest
import requests

from tests.faults.procs import gateway, worker

pytestmark = pytest.mark.e2e


def test_pd_pool_overflow_is_400_and_dead_decode_fails_fast():
    pool = ["--max-total-tokens", "256"]
    prefill, ph, pp = worker("--role", "prefill", *pool)
    decode, dh, dp = worker("--role", "decode", "--max-total-tokens", "1024")  # the prefill side refuses
    gw, url = None, None
    try:
        gw, url = gateway(f"{ph}:{pp},{dh}:{dp}")
        ok = requests.post(url + "/generate", json={"text": "pd works", "sampling_params": {"max_new_tokens": 4}},
                           timeout=60)
        assert ok.status_code == 200, ok.text
        big = requests.post(url + "/generate", json={"input_ids": list(range(3, 403)),
                                                     "sampling_params": {"max_new_tokens": 4}}, timeout=60)
        assert big.status_code == 400, big.text
        assert "KV cache" in big.json()["error"]["message"], big.text
        assert f"{ph}:{pp}" not in big.text and f"{dh}:{dp}" not in big.text  # the fleet's layout is internal

        os.killpg(decode.proc.pid, signal.SIGKILL)
        decode.proc.wait()
        deadline = time.monotonic() + 10
        while requests.get(url + "/health", timeout=5).status_code != 503:
            assert time.monotonic() < deadline, "health still says 200 with no decode worker"
            time.sleep(0.1)
        t0 = time.monotonic()
        r = requests.post(url + "/generate", json={"text": "anyone?", "sampling_params": {"max_new_tokens": 4}},
                          timeout=60)
        assert r.status_code == 503, r.text
        assert time.monotonic() - t0 < 2.0
        assert prefill.alive()
    finally:
        for p in (gw, prefill, decode):
            if p is not None:
                p.stop()
