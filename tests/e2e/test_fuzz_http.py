"""Random, mostly malformed bodies against the real stack: every answer is a 2xx or a 4xx with an
OpenAI-style error body — never a 5xx — and nothing is left running or holding KV afterwards."""
from __future__ import annotations

import json
import random

import pytest
import requests

pytestmark = pytest.mark.e2e

VALUES = [None, True, False, 0, -1, 1, 2 ** 40, 1.5, -0.5, 1e308, "", "x", "a" * 300, [], [1, 2], [[1]], {},
          {"a": 1}, [None], ["x"], {"type": "json_object"},
          {"type": "json_schema", "json_schema": {"name": "x", "schema": {"type": "object"}}},
          {"op": "gen"}, [{"op": "text", "text": "hi"}]]
OPENAI_KEYS = ["model", "messages", "max_tokens", "temperature", "top_p", "n", "stop", "stream", "logprobs",
               "top_logprobs", "seed", "response_format", "stream_options", "max_completion_tokens",
               "presence_penalty", "frequency_penalty", "logit_bias", "tools", "tool_choice", "user", "echo",
               "best_of", "prompt", "suffix", "min_p", "top_k", "ignore_eos", "regex"]
NATIVE_KEYS = ["text", "input_ids", "sampling_params", "stream", "return_logprob", "logprob_start_len",
               "top_logprobs_num", "rid", "return_text_in_logprobs"]
SAMPLING_KEYS = ["max_new_tokens", "temperature", "top_p", "top_k", "min_p", "stop", "stop_token_ids", "regex",
                 "json_schema", "ebnf", "n", "ignore_eos", "min_new_tokens", "seed", "logit_bias",
                 "repetition_penalty", "no_stop_trim", "skip_special_tokens"]
MESSAGES = [[{"role": "user", "content": "hi"}], [{"role": "bogus", "content": 1}], [], "x", [{"role": "user"}],
            [{"role": "system", "content": [{"type": "text", "text": "s"}]}, {"role": "user", "content": "q"}],
            [{"role": "assistant", "content": None}]]
PROGRAM_OPS = ["text", "gen", "select", "fork", "join", "role_begin", "role_end", "var", "bogus"]
PROGRAM_FIELDS = ["text", "name", "choices", "n", "branches", "sampling", "role", "fork", "mode", "max_tokens"]


def random_request(rng: random.Random) -> tuple[str, dict]:
    path = rng.choice(["/v1/chat/completions", "/v1/completions", "/generate", "/v1/programs"])
    pick = rng.choice
    if path == "/generate":
        body = {k: pick(VALUES) for k in rng.sample(NATIVE_KEYS, rng.randint(0, 6))}
        if rng.random() < 0.6:
            body["text"] = pick(["hello", "", ["a", "b"], 5])
        if rng.random() < 0.7:
            body["sampling_params"] = {k: pick(VALUES) for k in rng.sample(SAMPLING_KEYS, rng.randint(0, 6))}
    elif path == "/v1/programs":
        nodes = [{"op": pick(PROGRAM_OPS), **{k: pick(VALUES) for k in rng.sample(PROGRAM_FIELDS, 3)}}
                 for _ in range(rng.randint(1, 4))]
        body = pick([{}, {"program": pick(VALUES)}, {"program": {"version": 1, "nodes": nodes}},
                     {"program": {"version": 1, "nodes": pick(VALUES)}, "args": pick(VALUES)}])
    else:
        body = {k: pick(VALUES) for k in rng.sample(OPENAI_KEYS, rng.randint(0, 7))}
        if rng.random() < 0.6:
            body["model"] = "tiny-random"
        if path == "/v1/chat/completions" and rng.random() < 0.7:
            body["messages"] = pick(MESSAGES)
        if path == "/v1/completions" and rng.random() < 0.7:
            body["prompt"] = pick(["hi", [1, 2, 3], [[1], [2]], [], "", [["x"]]])
    # Keep accepted requests short: this test is about refusals, not generation.
    for k in ("max_tokens", "max_completion_tokens"):
        if isinstance(body.get(k), int) and body[k] > 16:
            body[k] = 4
    for k in ("n", "best_of"):
        if isinstance(body.get(k), int) and body[k] > 2:
            body[k] = 2
    sp = body.get("sampling_params")
    if isinstance(sp, dict) and isinstance(sp.get("max_new_tokens"), int) and sp["max_new_tokens"] > 16:
        sp["max_new_tokens"] = 4
    return path, body


def test_random_bodies_never_500(base_url):
    rng = random.Random(20261129)
    seen = set()
    for _ in range(400):
        path, body = random_request(rng)
        r = requests.post(base_url + path, data=json.dumps(body), timeout=60,
                          headers={"content-type": "application/json"})
        seen.add(r.status_code)
        assert r.status_code < 500, (path, body, r.text[:300])
        if r.status_code >= 400:
            err = r.json()["error"]
            assert {"message", "type", "param", "code"} <= set(err) and err["message"]
    assert 200 in seen and 400 in seen
    info = requests.get(base_url + "/server_info", timeout=10).json()
    for w in info["workers"]:
        assert w["info"]["num_running"] == 0 and w["info"]["num_waiting"] == 0
        assert w["info"]["kv_usage"] == 0.0  # every accepted request released its slots
