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


def test_standalone_worker_streams_aborts_and_leaks_nothing():
    """STANDALONE through the launcher: concurrent constrained and plain requests give spec off's tokens while
    streams are dropped mid-run around them (drafts pending); afterwards neither the target's pool nor the
    draft's holds anything (/server_info's kv_usage, draft_kv_usage, draft_rows)."""
    import concurrent.futures as cf
    import json

    from tests.support.stack import wait_for

    plain = Harness()
    jobs = [([5, 6, 7, 8, 9, 10, 11] * 5, {"temperature": 0, "max_new_tokens": 16}),
            ([20, 21, 22, 23] * 8, {"temperature": 0, "max_new_tokens": 16, "regex": "(ab|ba| )+x[0-9]{2}"}),
            ([30, 31, 32] * 9, {"temperature": 0, "max_new_tokens": 20, "json_schema": json.dumps(
                {"type": "object", "properties": {"a": {"type": "integer"}}, "required": ["a"]})}),
            ([40, 41] * 12, {"temperature": 0.8, "seed": 3, "max_new_tokens": 16})]
    want = [plain.generate(p, sampling=dict(sp))["ids"] for p, sp in jobs]
    s = Stack("--speculative-algorithm", "STANDALONE", "--speculative-draft-model-path", "tiny-random")
    try:
        def complete(job):
            body = {"input_ids": job[0], "sampling_params": job[1]}
            return requests.post(s.url + "/generate", json=body, timeout=60).json()["output_ids"]

        def dropped(i):
            sp = {"temperature": 0, "max_new_tokens": 2000, "ignore_eos": True, **({"regex": "(ab|ba| )+"} if i % 2 else {})}
            body = {"input_ids": [50 + i, 51, 52] * 6, "stream": True, "sampling_params": sp}
            with requests.post(s.url + "/generate", json=body, stream=True, timeout=60) as r:
                for n, _ in enumerate(line for line in r.iter_lines() if line.startswith(b"data:")):
                    if n == 3 + i:
                        return  # the connection closes mid-stream: the gateway aborts the request

        with cf.ThreadPoolExecutor(8) as ex:
            drops = [ex.submit(dropped, i) for i in range(4)]
            got = list(ex.map(complete, jobs))
            for d in drops:
                d.result()
        assert got == want

        def idle_info():
            info = requests.get(s.url + "/server_info", timeout=30).json()["workers"][0]["info"]
            return info if info["num_running"] == info["num_waiting"] == 0 else None
        info = wait_for(idle_info, 30, "the worker to go idle")
        spec = info["speculative"]
        assert spec["verifications"] > 0 and spec["accepted"] > 0
        assert info["kv_usage"] == 0.0 and spec["draft_kv_usage"] == 0.0 and spec["draft_rows"] == 0
    finally:
        s.stop()
