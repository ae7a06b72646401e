"""Nothing CPU-heavy runs on the gateway's event loop: while a huge prompt is tokenized (in a pool
process) /health keeps answering in well under a second; a prompt whose length alone proves it cannot
fit is refused without tokenizing; a body over the size cap is a 413."""
from __future__ import annotations

import threading
import time

import pytest
import requests

from tests.faults.procs import gateway, worker

pytestmark = pytest.mark.e2e


def _health_latencies_while(fn, url: str) -> tuple[list[float], object]:
    result: dict = {}
    t = threading.Thread(target=lambda: result.setdefault("r", fn()))
    t.start()
    latencies = []
    while t.is_alive():
        t0 = time.monotonic()
        r = requests.get(url + "/health", timeout=30)
        latencies.append(time.monotonic() - t0)
        assert r.status_code == 200
        time.sleep(0.05)
    t.join()
    return latencies, result["r"]


@pytest.fixture(scope="module")
def big_context_gateway():
    """A gateway told the context is huge, so a large prompt passes the length check and really is
    tokenized (the worker refuses it afterwards)."""
    w, host, port = worker()
    g, url = gateway(f"{host}:{port}", "--context-length", "100000000")
    yield url
    g.stop()
    w.stop()


def test_tokenizing_a_huge_prompt_leaves_health_responsive(big_context_gateway):
    url = big_context_gateway
    text = "hello world, this is a long prompt. " * 16_000  # 0.6 MB: ~3 s of tokenizing on a small CPU
    t0 = time.monotonic()
    latencies, r = _health_latencies_while(
        lambda: requests.post(url + "/generate", json={"text": text, "sampling_params": {"max_new_tokens": 1}},
                              timeout=300), url)
    took = time.monotonic() - t0
    assert r.status_code == 400, r.text  # the worker's context is far smaller
    assert len(latencies) >= 3, (took, latencies)
    assert max(latencies) < 1.0, latencies
    # Chat messages take the same road (template rendering included).
    latencies, r = _health_latencies_while(
        lambda: requests.post(url + "/v1/chat/completions", json={
            "messages": [{"role": "user", "content": text}], "max_tokens": 1}, timeout=300), url)
    assert r.status_code == 400, r.text
    assert max(latencies) < 1.0, latencies


def test_16mb_prompt_is_refused_without_blocking(base_url):
    text = "x" * 16_000_000
    latencies, r = _health_latencies_while(
        lambda: requests.post(base_url + "/generate", json={"text": text}, timeout=300), base_url)
    assert r.status_code == 400 and r.json()["error"]["code"] == "context_length_exceeded", r.text[:300]
    assert max(latencies, default=0) < 1.0, latencies
    r = requests.post(base_url + "/v1/completions", json={"prompt": "y" * 17_000_000}, timeout=300)
    assert r.status_code == 413 and r.json()["error"]["code"] == "request_too_large"
