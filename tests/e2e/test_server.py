"""The real stack (launcher, gateway, worker process, tiny model) through real HTTP clients."""
from __future__ import annotations

import json
import re
import signal
import time

import pytest
import requests
from openai import OpenAI

from tests.support.stack import Stack

pytestmark = pytest.mark.e2e


def post(url, path, body, **kw):
    return requests.post(url + path, json=body, timeout=60, **kw)


def test_openai_client_completions_and_streamed_chat(base_url):
    client = OpenAI(base_url=base_url + "/v1", api_key="none")
    models = client.models.list()
    assert models.data[0].id == "tiny-random"
    c = client.completions.create(model="tiny-random", prompt="Once upon a time", max_tokens=8, temperature=0)
    assert c.choices[0].finish_reason in ("length", "stop") and c.usage.completion_tokens <= 8
    chunks = list(client.chat.completions.create(
        model="tiny-random", messages=[{"role": "user", "content": "Hi there"}], max_tokens=8, stream=True,
        stream_options={"include_usage": True}, temperature=0))
    text = "".join(ch.choices[0].delta.content or "" for ch in chunks if ch.choices)
    finals = [ch for ch in chunks if ch.choices and ch.choices[0].finish_reason]
    assert len(finals) == 1
    assert chunks[-1].usage is not None and chunks[-1].choices == []
    assert chunks[-1].usage.completion_tokens >= 1
    full = client.chat.completions.create(model="tiny-random", messages=[{"role": "user", "content": "Hi there"}],
                                          max_tokens=8, temperature=0)
    assert full.choices[0].message.content == text


def test_second_identical_request_reports_cached_tokens(base_url):
    prompt = "A shared prefix that is long enough to be worth caching: " + "lorem ipsum " * 10
    r1 = post(base_url, "/v1/completions", {"model": "tiny-random", "prompt": prompt, "max_tokens": 4}).json()
    r2 = post(base_url, "/v1/completions", {"model": "tiny-random", "prompt": prompt, "max_tokens": 4}).json()
    n = r1["usage"]["prompt_tokens"]
    assert r2["usage"]["prompt_tokens_details"]["cached_tokens"] == n - 1
    g = post(base_url, "/generate", {"text": prompt, "sampling_params": {"max_new_tokens": 2}}).json()
    assert g["meta_info"]["cached_tokens"] == n - 1


def test_tokenize_counts_what_the_routes_bill(base_url):
    """/tokenize through the real stack: its count is the completion's and the chat's prompt_tokens, and
    /detokenize gives the text back."""
    prompt, messages = "Once upon a time there was", [{"role": "user", "content": "Hi there"}]
    t = post(base_url, "/tokenize", {"model": "tiny-random", "prompt": prompt}).json()
    c = post(base_url, "/v1/completions", {"model": "tiny-random", "prompt": prompt, "max_tokens": 1}).json()
    assert t["count"] == c["usage"]["prompt_tokens"] == len(t["tokens"]) and t["max_model_len"] > 0
    tm = post(base_url, "/v1/tokenize", {"messages": messages}).json()
    cm = post(base_url, "/v1/chat/completions", {"messages": messages, "max_tokens": 1}).json()
    assert tm["count"] == cm["usage"]["prompt_tokens"]
    d = post(base_url, "/detokenize", {"tokens": t["tokens"]}).json()
    assert d["text"] == d["prompt"] == prompt


def test_native_generate_batch_stream_and_logprobs(base_url):
    r = post(base_url, "/generate", {"text": ["a b c", "d e f"], "sampling_params": {"max_new_tokens": 3,
                                                                                      "temperature": 0}})
    assert r.status_code == 200 and len(r.json()) == 2
    body = {"text": "Streaming test", "stream": True, "sampling_params": {"max_new_tokens": 6, "temperature": 0}}
    with requests.post(base_url + "/generate", json=body, stream=True, timeout=60) as resp:
        assert "charset=utf-8" in resp.headers["content-type"].lower()
        events = [line[6:].decode() for line in resp.iter_lines() if line.startswith(b"data: ")]
    assert events[-1] == "[DONE]"
    texts = [json.loads(e)["text"] for e in events[:-1]]
    assert all(texts[i + 1].startswith(texts[i]) for i in range(len(texts) - 1))  # cumulative
    plain = post(base_url, "/generate", {**body, "stream": False}).json()
    assert texts[-1] == plain["text"]
    lp = post(base_url, "/generate", {"text": "score me please", "sampling_params": {"max_new_tokens": 0},
                                      "return_logprob": True, "logprob_start_len": 0,
                                      "return_text_in_logprobs": True}).json()
    entries = lp["meta_info"]["input_token_logprobs"]
    assert entries[0][0] is None and all(isinstance(e[0], float) for e in entries[1:])
    assert all(isinstance(e[2], str) for e in entries)


def test_bad_inputs_get_openai_errors(base_url):
    cases = [
        ("/v1/completions", {"model": "nope", "prompt": "x"}),
        ("/v1/completions", {"model": "tiny-random", "prompt": "x", "max_tokens": -1}),
        ("/v1/completions", {"model": "tiny-random", "prompt": 5}),
        ("/v1/chat/completions", {"model": "tiny-random", "messages": []}),
        ("/v1/completions", {"model": "tiny-random", "prompt": "x", "n": 10_000}),
        ("/v1/completions", {"model": "tiny-random", "prompt": "hello " * 5000}),
        ("/generate", {"text": "x", "sampling_params": {"temperature": "hot"}}),
    ]
    for path, body in cases:
        r = post(base_url, path, body)
        assert 400 <= r.status_code < 500, (path, body, r.status_code, r.text)
        err = r.json()["error"]
        assert {"message", "type", "param", "code"} <= set(err)
    r = post(base_url, "/v1/completions", {"model": "tiny-random", "prompt": "hello " * 5000})
    assert "context_length_exceeded" in json.dumps(r.json())
    r = requests.post(base_url + "/v1/completions", data=b"x" * (64 * 1024 * 1024), timeout=60,
                      headers={"content-type": "application/json"})
    assert r.status_code == 413


def test_client_disconnect_frees_the_request(base_url):
    body = {"text": "disconnect me", "stream": True,
            "sampling_params": {"max_new_tokens": 3000, "ignore_eos": True}}
    with requests.post(base_url + "/generate", json=body, stream=True, timeout=60) as resp:
        it = resp.iter_lines()
        next(it)
        assert _running(requests.get(base_url + "/server_info", timeout=10).json()) == 1
    # The worker must see the abort: nothing running shortly after.
    deadline = time.monotonic() + 20
    while time.monotonic() < deadline:
        info = requests.get(base_url + "/server_info", timeout=10).json()
        if _running(info) == 0:
            break
        time.sleep(0.2)
    assert _running(info) == 0, info


def _running(info) -> int:
    workers = [w["info"] for w in info["workers"]]
    assert workers and all(w is not None for w in workers), info
    return sum(w["num_running"] + w["num_waiting"] for w in workers)


def test_health_and_metrics(base_url):
    assert requests.get(base_url + "/health", timeout=10).status_code == 200
    m = requests.get(base_url + "/metrics", timeout=10).text
    assert "sglang:prompt_tokens_total" in m and "sglang:time_to_first_token_seconds" in m
    info = requests.get(base_url + "/get_model_info", timeout=10).json()
    assert info["model_path"] == "tiny-random"


def test_sigterm_stops_the_stack_cleanly():
    s = Stack("--workers", "2")
    try:
        for _ in range(4):
            r = post(s.url, "/generate", {"text": "two workers", "sampling_params": {"max_new_tokens": 2}})
            assert r.status_code == 200
    finally:
        s.stop()
    assert s.proc.returncode == 0


def test_structured_output_through_the_stack(base_url):
    import jsonschema

    # Bounded fields: a random model would otherwise write digits until max_tokens cuts the JSON off.
    schema = {"type": "object", "properties": {"city": {"type": "string", "maxLength": 12},
                                               "population": {"type": "integer", "minimum": 0, "maximum": 99999999}},
              "required": ["city", "population"], "additionalProperties": False}
    client = OpenAI(base_url=base_url + "/v1", api_key="none")
    r = client.chat.completions.create(
        model="tiny-random", messages=[{"role": "user", "content": "Give me a city as JSON"}], max_tokens=200,
        response_format={"type": "json_schema", "json_schema": {"name": "city", "schema": schema, "strict": True}})
    jsonschema.validate(json.loads(r.choices[0].message.content), schema)
    g = post(base_url, "/generate", {"text": "Date: ", "sampling_params": {"regex": r"\d{4}-\d{2}-\d{2}",
                                                                          "max_new_tokens": 20}}).json()
    assert re.fullmatch(r"\d{4}-\d{2}-\d{2}", g["text"])
    # Bad grammars are refused at the gateway, quickly, with the field named.
    t0 = time.monotonic()
    for body, param in [({"regex": "(unclosed"}, "regex"), ({"json_schema": "{bad"}, "json_schema")]:
        r = post(base_url, "/generate", {"text": "x", "sampling_params": {**body, "max_new_tokens": 4}})
        assert r.status_code == 400 and r.json()["error"]["param"] == param, r.text
    r = post(base_url, "/generate", {"text": "x", "sampling_params": {"regex": "(a+)+$", "max_new_tokens": 4}})
    assert r.status_code in (200, 400)
    assert time.monotonic() - t0 < 10


def test_vllm_structured_outputs_through_the_stack(base_url):
    """A vLLM client's constraints hold end to end: `structured_outputs` and the older `guided_*` fields."""
    import jsonschema

    client = OpenAI(base_url=base_url + "/v1", api_key="none")
    choices = ["positive", "negative", "neutral"]
    for extra in ({"structured_outputs": {"choice": choices}}, {"guided_choice": choices}):
        r = client.chat.completions.create(model="tiny-random", messages=[{"role": "user", "content": "Mood?"}],
                                           max_tokens=20, extra_body=extra)
        assert r.choices[0].message.content in choices, (extra, r.choices[0].message.content)
    for extra in ({"structured_outputs": {"regex": r"[0-9]{3}-[a-z]{2}"}}, {"guided_regex": r"[0-9]{3}-[a-z]{2}"}):
        r = client.completions.create(model="tiny-random", prompt="Code: ", max_tokens=20, extra_body=extra)
        assert re.fullmatch(r"[0-9]{3}-[a-z]{2}", r.choices[0].text), (extra, r.choices[0].text)
    schema = {"type": "object", "properties": {"ok": {"type": "boolean"}}, "required": ["ok"],
              "additionalProperties": False}
    r = client.completions.create(model="tiny-random", prompt="JSON: ", max_tokens=30,
                                  extra_body={"structured_outputs": {"json": schema}})
    jsonschema.validate(json.loads(r.choices[0].text), schema)
    r = post(base_url, "/v1/completions", {"model": "tiny-random", "prompt": "x", "max_tokens": 4,
                                           "structured_outputs": {"grammar": "root ::= ("}})
    assert r.status_code == 400 and r.json()["error"]["param"] == "structured_outputs.grammar", r.text
    # vLLM's prompt truncation: the prompt's last 8 tokens are what is computed and billed.
    r = client.completions.create(model="tiny-random", prompt=list(range(20, 60)), max_tokens=2,
                                  extra_body={"truncate_prompt_tokens": 8})
    assert r.usage.prompt_tokens == 8


def test_api_keys_are_tenants_with_separate_caches():
    """Each API key gets its own cache namespace: a second tenant sending the same prompt gets no
    cached tokens (no cross-tenant timing probe), while each tenant still reuses its own prefix."""
    s = Stack("--api-key", "key-a,key-b")
    try:
        prompt = "tenant isolation check " * 8
        body = {"model": "tiny-random", "prompt": prompt, "max_tokens": 2}

        def cached(key):
            r = post(s.url, "/v1/completions", body, headers={"Authorization": f"Bearer {key}"})
            assert r.status_code == 200, r.text
            return r.json()["usage"]["prompt_tokens_details"]["cached_tokens"]

        assert post(s.url, "/v1/completions", body).status_code == 401
        assert post(s.url, "/v1/completions", body, headers={"Authorization": "Bearer key-c"}).status_code == 401
        assert cached("key-a") == 0
        assert cached("key-a") > 0
        assert cached("key-b") == 0
        assert cached("key-b") > 0
    finally:
        s.stop()


def test_sigterm_lets_running_requests_finish():
    """A rolling restart loses nothing accepted: SIGTERM stops new connections, the stream in flight
    runs to its end, then the stack exits cleanly."""
    s = Stack()
    try:
        body = {"text": "drain me", "stream": True,
                "sampling_params": {"max_new_tokens": 3000, "ignore_eos": True}}
        with requests.post(s.url + "/generate", json=body, stream=True, timeout=60) as resp:
            lines = resp.iter_lines()
            next(line for line in lines if line.startswith(b"data: "))
            s.proc.send_signal(signal.SIGTERM)
            events = [line[6:] for line in lines if line.startswith(b"data: ")]
        assert events[-1] == b"[DONE]"
        last = json.loads(events[-2])
        assert last["meta_info"]["finish_reason"] == {"type": "length", "length": 3000}
        assert s.proc.wait(30) == 0
    finally:
        s.stop()


def test_metrics_exposition_has_no_created_series(base_url):
    m = requests.get(base_url + "/metrics", timeout=10).text
    assert "_created" not in m and "sglang:num_running_reqs" in m and "sglang:token_usage" in m


def test_services_run_on_uvloop(base_url):
    """The gateway and every worker run their IO on uvloop (shared/event_loop.py), not asyncio's loop."""
    info = requests.get(base_url + "/server_info", timeout=10).json()
    assert info["event_loop"].startswith("uvloop"), info["event_loop"]
    assert all(w["info"]["event_loop"].startswith("uvloop") for w in info["workers"]), info["workers"]


def test_stream_interval_sends_tokens_in_increments():
    """`--stream-interval 4` through the launcher: a streamed completion arrives as the first token, then
    increments of four, and its text equals the non-streamed completion's."""
    s = Stack("--stream-interval", "4")
    try:
        body = {"model": "tiny-random", "prompt": "stream interval check", "max_tokens": 21,
                "temperature": 0, "ignore_eos": True}
        whole = post(s.url, "/v1/completions", body).json()["choices"][0]["text"]
        with requests.post(s.url + "/v1/completions", json={**body, "stream": True}, stream=True, timeout=60) as r:
            events = [json.loads(line[6:]) for line in r.iter_lines()
                      if line.startswith(b"data: ") and line != b"data: [DONE]"]
        texts = [e["choices"][0]["text"] for e in events if e["choices"]]
        assert "".join(texts) == whole
        content = [t for t in texts if t]
        # 21 tokens: 1, then 4 x 5 -> at most 6 increments with text (one per token would be 21).
        assert 2 <= len(content) <= 7, texts
    finally:
        s.stop()
