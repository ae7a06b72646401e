"""Cache-aware routing through the real stack: two worker processes, conversations that all start with the
same system prompt. Concurrent first turns spread over both workers; every later turn finds its history
in the cache of the worker it lands on."""
from __future__ import annotations

import concurrent.futures as cf

import pytest
import requests

from tests.support.stack import Stack

pytestmark = pytest.mark.e2e

SYSTEM = "You are a careful assistant. Answer briefly and cite the passage. " * 3


def chat(url: str, messages: list[dict]) -> dict:
    r = requests.post(url + "/v1/chat/completions", json={
        "model": "tiny-random", "messages": messages, "max_tokens": 8, "temperature": 0}, timeout=60)
    assert r.status_code == 200, r.text
    return r.json()


def test_conversations_spread_and_each_turn_hits_its_history():
    s = Stack("--workers", "2")
    try:
        convs = [[{"role": "system", "content": SYSTEM}, {"role": "user", "content": f"Question {i}: " + "why " * 10}]
                 for i in range(8)]
        with cf.ThreadPoolExecutor(8) as ex:
            firsts = list(ex.map(lambda m: chat(s.url, m), convs))
        infos = [w["info"] for w in requests.get(s.url + "/server_info", timeout=10).json()["workers"]]
        assert all(i["prompt_tokens"] > 0 for i in infos), infos  # both workers took conversations
        for msgs, first in zip(convs, firsts):
            msgs += [{"role": "assistant", "content": first["choices"][0]["message"]["content"]},
                     {"role": "user", "content": "And then?"}]
            second = chat(s.url, msgs)
            history = first["usage"]["prompt_tokens"]
            # The whole first turn's prompt (and more) came from the cache of the worker holding it.
            cached = second["usage"]["prompt_tokens_details"]["cached_tokens"]
            assert cached >= history - 1, (first["usage"], second["usage"])
    finally:
        s.stop()
