"""Speculative decoding through the real services: a worker started by the launcher with NGRAM answers
/generate with the same greedy tokens as the engine without speculation, and reports its verifications."""
from __future__ import annotations

import pytest
import requests

from tests.support.engine_harness import Harness
from tests.support.stack import Stack

pytestmark = pytest.mark.e2e


def test_ngram_worker_generates_the_plain_greedy_tokens():
    prompt = [5, 6, 7, 8, 9, 10, 11] * 5
    want = Harness().generate(prompt, sampling={"temperature": 0, "max_new_tokens": 16, "ignore_eos": True})
    s = Stack("--speculative-algorithm", "NGRAM", "--speculative-num-draft-tokens", "5")
    try:
        body = {"input_ids": prompt, "sampling_params": {"temperature": 0, "max_new_tokens": 16, "ignore_eos": True}}
        res = requests.post(s.url + "/generate", json=body, timeout=60).json()
        assert res["output_ids"] == want["ids"] and res["text"] == want["text"]
        assert res["meta_info"]["spec_verify_ct"] > 0
        info = requests.get(s.url + "/get_server_info", timeout=30).json()
        spec = info["workers"][0]["info"]["speculative"]
        assert spec["algorithm"] == "NGRAM" and spec["verifications"] > 0
    finally:
        s.stop()
