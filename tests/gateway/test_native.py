"""SGLang-native `/generate` and the service routes (model/server info, flush, health, metrics) over a fake
worker; client disconnects abort on the worker; `start_gateway` serves on a real port."""
import asyncio

import aiohttp
import pytest

from services.gateway.__main__ import build_parser, start_gateway
from shared.protocol import GenerateRequest
from tests.support.fake_worker import FakeWorker, fake_logprob, gateway_stack, sse_events


@pytest.fixture
async def stack():
    async with gateway_stack() as s:
        yield s


def generated(stack):
    return [m for m in stack.worker.received if isinstance(m, GenerateRequest) and not m.rid.startswith("health-")]


async def generate(stack, body, status=200):
    r = await stack.client.post("/generate", json=body)
    assert r.status == status, await r.text()
    return await r.json()


# ---------------------------------------------------------------- /generate
async def test_single_text(stack):
    tok = stack.state.tokenizer
    out = await generate(stack, {"text": "Hello", "sampling_params": {"max_new_tokens": 5}, "rid": "r1"})
    ids = tok.encode("Hello")
    expect = stack.worker.expected_ids(ids, 5)
    assert out["output_ids"] == expect and out["text"] == tok.decode(expect)
    meta = out["meta_info"]
    assert meta["id"] == "r1" and meta["finish_reason"] == {"type": "length", "length": 5}
    assert meta["prompt_tokens"] == len(ids) and meta["completion_tokens"] == 5 and meta["cached_tokens"] == 0
    assert meta["e2e_latency"] > 0
    assert "input_token_logprobs" not in meta


async def test_default_budget_is_128_and_cached_tokens_reported(stack):
    ids = list(range(10, 40))
    out = await generate(stack, {"input_ids": ids})
    assert out["meta_info"]["completion_tokens"] == 128
    out = await generate(stack, {"input_ids": ids[:20] + [7] * 10, "sampling_params": {"max_new_tokens": 1}})
    assert out["meta_info"]["cached_tokens"] == 20  # the fake worker's prefix "cache"
    # Near the end of the context the default shrinks instead of refusing.
    out = await generate(stack, {"input_ids": [5] * 250})
    assert out["meta_info"]["completion_tokens"] == 6


async def test_batch_text_and_input_ids(stack):
    tok = stack.state.tokenizer
    out = await generate(stack, {"text": ["Hello", "The quick"],
                                 "sampling_params": [{"max_new_tokens": 2}, {"max_new_tokens": 3}]})
    assert isinstance(out, list) and [len(o["output_ids"]) for o in out] == [2, 3]
    assert out[1]["output_ids"] == stack.worker.expected_ids(tok.encode("The quick"), 3)
    out = await generate(stack, {"input_ids": [[5, 6], [7]], "sampling_params": {"max_new_tokens": 1}})
    assert [o["meta_info"]["prompt_tokens"] for o in out] == [2, 1]


async def test_n_returns_a_list_with_suffixed_ids(stack):
    out = await generate(stack, {"text": "Hello", "rid": "fork", "sampling_params": {"max_new_tokens": 2, "n": 3}})
    assert [o["meta_info"]["id"] for o in out] == ["fork-0", "fork-1", "fork-2"]


async def test_prefill_only(stack):
    out = await generate(stack, {"text": "The quick brown", "sampling_params": {"max_new_tokens": 0}})
    assert out["text"] == "" and out["output_ids"] == []
    assert out["meta_info"]["prompt_tokens"] == len(stack.state.tokenizer.encode("The quick brown"))


async def test_logprob_entries(stack):
    tok = stack.state.tokenizer
    ids = tok.encode("The quick brown fox")
    out = await generate(stack, {"input_ids": ids, "sampling_params": {"max_new_tokens": 2}, "return_logprob": True,
                                 "logprob_start_len": 0, "top_logprobs_num": 2, "return_text_in_logprobs": True})
    meta = out["meta_info"]
    inp = meta["input_token_logprobs"]
    assert inp[0] == [None, ids[0], tok.token_text(ids[0])]
    assert [e[:2] for e in inp[1:]] == [[fake_logprob(p), ids[p]] for p in range(1, len(ids))]
    assert meta["output_token_logprobs"] == [[fake_logprob(k), t, tok.token_text(t)]
                                             for k, t in enumerate(out["output_ids"])]
    assert meta["input_top_logprobs"][0] is None
    assert all(len(pos) == 2 and len(pos[0]) == 3 for pos in meta["input_top_logprobs"][1:])
    assert all(len(pos) == 2 for pos in meta["output_top_logprobs"])
    # Without return_text_in_logprobs the text slot is null.
    out = await generate(stack, {"input_ids": ids, "sampling_params": {"max_new_tokens": 1}, "return_logprob": True})
    assert all(e[2] is None for e in out["meta_info"]["output_token_logprobs"])


async def test_select_style_scoring_request(stack):
    """What the SGLang frontend's select() sends: a batch, prefill only, logprobs from prompt_tokens - 2."""
    tok = stack.state.tokenizer
    base = (await generate(stack, {"text": "Answer:", "sampling_params": {"max_new_tokens": 0}}))
    start = base["meta_info"]["prompt_tokens"] - 2
    out = await generate(stack, {"text": ["Answer: yes", "Answer: no"], "sampling_params": {"max_new_tokens": 0},
                                 "return_logprob": True, "logprob_start_len": start,
                                 "return_text_in_logprobs": True})
    for o, choice in zip(out, ["Answer: yes", "Answer: no"]):
        entries = o["meta_info"]["input_token_logprobs"]
        assert len(entries) == len(tok.encode(choice)) - start
        assert all(e[0] is not None for e in entries)


async def test_stream_is_cumulative(stack):
    r = await stack.client.post("/generate", json={"text": "Hello", "stream": True,
                                                   "sampling_params": {"max_new_tokens": 5}})
    events = sse_events(await r.text())
    assert events[-1] == "[DONE]"
    events = events[:-1]
    # One event per token, or fewer when tokens queued up behind a busy consumer (one increment).
    assert 1 <= len(events) <= 5 and len(events[-1]["output_ids"]) == 5
    for prev, cur in zip(events, events[1:]):
        assert cur["text"].startswith(prev["text"]) and cur["output_ids"][:len(prev["output_ids"])] == prev["output_ids"]
    assert [e["meta_info"]["finish_reason"] for e in events[:-1]] == [None] * (len(events) - 1)
    final = await generate(stack, {"text": "Hello", "sampling_params": {"max_new_tokens": 5}})
    assert events[-1]["text"] == final["text"] and events[-1]["meta_info"]["finish_reason"]["type"] == "length"


async def test_batch_stream_carries_index(stack):
    r = await stack.client.post("/generate", json={"text": ["a", "b"], "stream": True,
                                                   "sampling_params": {"max_new_tokens": 3}})
    events = sse_events(await r.text())[:-1]
    assert {e["index"] for e in events} == {0, 1}
    assert sum(e["meta_info"]["finish_reason"] is not None for e in events) == 2


async def test_stream_error_event(stack):
    stack.worker.error_after = 1
    r = await stack.client.post("/generate", json={"text": "a", "stream": True, "sampling_params": {"max_new_tokens": 5}})
    events = sse_events(await r.text())
    assert events[-1]["error"]["message"] == "worker exploded" and "[DONE]" not in events


async def test_unknown_sampling_keys_are_ignored(stack):
    out = await generate(stack, {"text": "x", "sampling_params": {"max_new_tokens": 1, "fancy_new_knob": 3}})
    assert len(out["output_ids"]) == 1


@pytest.mark.parametrize("body,param", [
    ({}, "text"),
    ({"text": "a", "input_ids": [1]}, "text"),
    ({"text": ""}, "text"),
    ({"text": []}, "text"),
    ({"text": 5}, "text"),
    ({"input_ids": []}, "input_ids"),
    ({"input_ids": [1, "2"]}, "input_ids"),
    ({"input_ids": [1, True]}, "input_ids"),
    ({"input_ids": [[1], [2.0]]}, "input_ids"),
    ({"input_ids": [99999]}, "input_ids"),
    ({"input_ids": [[1], []]}, "input_ids"),
    ({"input_ids": 1}, "input_ids"),
    ({"input_ids": "1 2"}, "input_ids"),
    ({"text": "a", "sampling_params": 3}, "sampling_params"),
    ({"text": ["a", "b"], "sampling_params": [{}]}, "sampling_params"),
    ({"text": "a", "sampling_params": {"max_new_tokens": -1}}, "max_new_tokens"),
    ({"text": "a", "sampling_params": {"temperature": "hot"}}, "temperature"),
    ({"text": "a", "sampling_params": {"top_k": 0}}, "top_k"),
    ({"text": "a", "sampling_params": {"top_k": 1e308}}, "top_k"),
    ({"text": "a", "sampling_params": {"regex": "a", "json_schema": "{}"}}, "json_schema"),
    ({"text": "a", "sampling_params": {"stop_token_ids": [10 ** 6]}}, "stop_token_ids"),
    ({"text": "a", "sampling_params": {"n": 100}}, "n"),
    ({"text": "a", "return_logprob": "yes"}, "return_logprob"),
    ({"text": "a", "logprob_start_len": -2}, "logprob_start_len"),
    ({"text": "a", "top_logprobs_num": 1000}, "top_logprobs_num"),
    ({"text": "a", "rid": 7}, "rid"),
    ({"text": ["a", "b"], "rid": ["x", ""]}, "rid"),
    ({"text": ["a", "b"], "return_logprob": [True, None, False]}, "return_logprob"),
    ({"text": "a", "stream": 1}, "stream"),
    ({"input_ids": [5] * 256}, "input_ids"),
    ({"input_ids": [5] * 10, "sampling_params": {"max_new_tokens": 250}}, "max_new_tokens"),
])
async def test_bad_native_input(stack, body, param):
    err = (await generate(stack, body, status=400))["error"]
    assert err["param"] == param and err["message"]
    assert not generated(stack)


async def test_per_input_fields_may_leave_an_input_out(stack):
    body = {"text": ["a", "b"], "rid": ["x", None], "top_logprobs_num": [None, 0],
            "sampling_params": [None, {"max_new_tokens": 2}]}
    out = await generate(stack, body)
    assert out[0]["meta_info"]["id"] == "x" and out[1]["meta_info"]["id"] != "x"
    assert [o["meta_info"]["completion_tokens"] for o in out] == [128, 2]


async def test_duplicate_running_rid_is_refused(stack):
    stack.worker.token_delay = 0.05
    task = asyncio.create_task(generate(stack, {"text": "a", "rid": "same", "sampling_params": {"max_new_tokens": 20}}))
    await asyncio.sleep(0.2)
    err = (await generate(stack, {"text": "b", "rid": "same"}, status=400))["error"]
    assert err["param"] == "rid"
    await task


# ---------------------------------------------------------------- disconnects
async def wait_for_abort(worker, predicate, timeout=3.0):
    for _ in range(int(timeout / 0.02)):
        aborted = worker.aborted()
        if predicate(aborted):
            return aborted
        await asyncio.sleep(0.02)
    raise AssertionError(f"no abort reached the worker; got {worker.aborted()}")


@pytest.mark.parametrize("path,body", [
    ("/generate", {"text": "a", "stream": True, "rid": "gone", "sampling_params": {"max_new_tokens": 200}}),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "a"}], "stream": True, "n": 2,
                              "max_tokens": 200}),
    ("/v1/completions", {"prompt": "a", "stream": True, "max_tokens": 200}),
])
async def test_disconnect_while_streaming_aborts_on_worker(stack, path, body):
    stack.worker.token_delay = 0.02
    async with aiohttp.ClientSession() as session:
        resp = await session.post(stack.server.make_url(path), json=body)
        await resp.content.readuntil(b"\n\n")
        await resp.content.readuntil(b"\n\n")
        resp.close()  # hang up mid-stream
    rids = {r.rid for r in generated(stack)}
    await wait_for_abort(stack.worker, lambda a: rids <= a)
    assert not set(stack.worker.finished_rids) & rids
    await asyncio.sleep(0.1)
    assert not stack.state.dispatcher.inflight and stack.state.router.load == 0


@pytest.mark.parametrize("path,body", [
    ("/generate", {"text": ["a", "b"], "sampling_params": {"max_new_tokens": 200}}),
    ("/v1/completions", {"prompt": "a", "n": 3, "max_tokens": 200}),
])
async def test_disconnect_without_streaming_aborts_on_worker(stack, path, body):
    stack.worker.token_delay = 0.02

    async def call():
        async with aiohttp.ClientSession() as session:
            await session.post(stack.server.make_url(path), json=body)

    task = asyncio.create_task(call())
    await asyncio.sleep(0.3)
    task.cancel()  # the client gives up: its connection closes
    rids = {r.rid for r in generated(stack)}
    assert len(rids) in (2, 3)
    await wait_for_abort(stack.worker, lambda a: rids <= a)


# ---------------------------------------------------------------- service routes
async def test_model_and_server_info(stack):
    for path in ("/get_model_info", "/model_info"):
        info = await (await stack.client.get(path)).json()
        assert info["model_path"] == "tiny-random" and info["is_generation"] is True and info["tokenizer_path"]
    for path in ("/server_info", "/get_server_info"):
        info = await (await stack.client.get(path)).json()
        assert info["context_length"] == 256 and info["workers"][0]["info"]["max_context_len"] == 256


async def test_flush_cache(stack):
    r = await stack.client.post("/flush_cache")
    assert r.status == 200 and r.content_type == "text/plain"
    stack.worker.token_delay = 0.05
    task = asyncio.create_task(generate(stack, {"text": "a", "sampling_params": {"max_new_tokens": 20}}))
    await asyncio.sleep(0.2)
    r = await stack.client.post("/flush_cache")
    assert r.status == 400 and "running" in await r.text()
    await task
    stack.worker.flush_ok = False
    assert (await stack.client.post("/flush_cache")).status == 400


async def test_health_waits_for_workers():
    async with gateway_stack(wait_healthy=False, context_length=None) as s:
        s.worker.silent = True  # answers nothing: never probed
        await asyncio.sleep(0.1)
        assert (await s.client.get("/health")).status == 503
        s.worker.silent = False
        await s.worker.drop_connections()  # the pending probe fails over, then a fresh one passes
        for _ in range(200):
            if (await s.client.get("/health")).status == 200:
                break
            await asyncio.sleep(0.05)
        assert (await s.client.get("/health")).status == 200
        assert s.state.context_length == 256  # learnt from the worker's info
        assert (await s.client.get("/health_generate")).status == 200
        await s.worker.stop()
        await asyncio.sleep(0.1)
        assert (await s.client.get("/health")).status == 503


async def test_metrics(stack):
    await generate(stack, {"input_ids": list(range(10, 30)), "sampling_params": {"max_new_tokens": 4}})
    await generate(stack, {"input_ids": list(range(10, 30)), "sampling_params": {"max_new_tokens": 4}})
    r = await stack.client.get("/metrics")
    text = await r.text()
    values = {line.split("{")[0]: float(line.rsplit(" ", 1)[1]) for line in text.splitlines()
              if line.startswith("sglang:") and "_bucket" not in line and "_created" not in line}
    assert values["sglang:prompt_tokens_total"] >= 40
    assert values["sglang:generation_tokens_total"] >= 8
    assert values["sglang:cached_tokens_total"] >= 19
    assert values["sglang:prefix_cache_queried_tokens_total"] >= 40
    assert values["sglang:num_requests_total"] >= 2
    for h in ("time_to_first_token_seconds", "inter_token_latency_seconds", "e2e_request_latency_seconds",
              "queue_time_seconds"):
        assert values[f"sglang:{h}_count"] >= 2
    assert values["sglang:token_usage"] == 0.25
    assert "sglang:num_running_reqs" in values and "sglang:num_queue_reqs" in values


async def test_requests_spread_over_workers():
    async with gateway_stack(num_workers=2) as s:
        for i in range(12):
            await generate(s, {"input_ids": [i + 5, i + 6], "sampling_params": {"max_new_tokens": 1}})
        counts = [sum(isinstance(m, GenerateRequest) and not m.rid.startswith("health-") for m in w.received)
                  for w in s.workers]
        assert sum(counts) == 12 and min(counts) > 0


# ---------------------------------------------------------------- the service entry point
async def test_start_gateway_serves_on_a_real_port():
    from shared.tokenizer import Tokenizer

    worker = FakeWorker(Tokenizer.load("tiny-random"))
    port = await worker.start()
    args = build_parser().parse_args(["--model-path", "tiny-random", "--workers", f"127.0.0.1:{port}",
                                      "--port", "0", "--served-model-name", "tiny"])
    runner, state = await start_gateway(args)
    try:
        host, gw_port = runner.addresses[0][:2]
        async with aiohttp.ClientSession() as session:
            for _ in range(100):
                async with session.get(f"http://{host}:{gw_port}/health") as r:
                    if r.status == 200:
                        break
                await asyncio.sleep(0.05)
            assert r.status == 200
            async with session.post(f"http://{host}:{gw_port}/v1/completions",
                                    json={"model": "tiny", "prompt": "hi", "max_tokens": 2}) as r:
                assert r.status == 200 and (await r.json())["usage"]["completion_tokens"] == 2
        assert state.context_length == 256
    finally:
        await runner.cleanup()
        await worker.stop()


# ---------------------------------------------------------------- /v1/programs wiring
PROGRAM = {"version": 1, "name": "qa", "args": [], "nodes": [
    {"op": "text", "text": "Question: What is the capital of France? Answer:"},
    {"op": "gen", "name": "answer", "sampling_params": {"max_new_tokens": 4}},
    {"op": "select", "name": "ok", "choices": ["yes", "no"], "temperature": 0.0,
     "method": "token_length_normalized"},
]}


async def test_program_runs_through_the_native_path(stack):
    r = await stack.client.post("/v1/programs", json={"program": PROGRAM})
    assert r.status == 200, await r.text()
    out = await r.json()
    assert set(out["variables"]) == {"answer", "ok"} and out["variables"]["ok"] in ("yes", "no")
    assert out["text"].startswith("Question:")
    assert generated(stack)  # the gen and the select's scoring went to the worker
    r = await stack.client.post("/v1/programs", json={"program": PROGRAM, "stream": True})
    events = sse_events(await r.text())
    assert events[-1] == "[DONE]" and events[-2]["type"] == "result"


async def test_bad_program_is_400(stack):
    r = await stack.client.post("/v1/programs", json={"program": {**PROGRAM, "version": 9}})
    assert r.status == 400 and "version" in (await r.json())["error"]["message"]
    stack.worker.refuse = "no"
    r = await stack.client.post("/v1/programs", json={"program": PROGRAM})
    assert r.status == 400 and (await r.json())["error"]["message"] == "no"


def test_metrics_count_every_token_gap():
    """A scrape shows every request accounted before it; an increment of n tokens is n inter-token gaps."""
    from services.gateway.http.metrics import GatewayMetrics, RequestTimer
    from shared.protocol import FinishLength, TokenOutput

    m = GatewayMetrics("m")
    timer = RequestTimer(m)
    timer.observe(TokenOutput(rid="a", token_ids=[1], text="x", prompt_tokens=7))
    timer.observe(TokenOutput(rid="a", token_ids=[2, 3], text="yz", finished=True,
                              finish_reason=FinishLength(length=3), prompt_tokens=7, completion_tokens=3))
    text = m.render().decode()
    for line in ('sglang:num_requests_total{model_name="m"} 1.0', 'sglang:prompt_tokens_total{model_name="m"} 7.0',
                 'sglang:generation_tokens_total{model_name="m"} 3.0',
                 'sglang:inter_token_latency_seconds_count{model_name="m"} 2.0',
                 'sglang:time_to_first_token_seconds_count{model_name="m"} 1.0',
                 'sglang:e2e_request_latency_seconds_count{model_name="m"} 1.0'):
        assert line in text, line


def test_host_tier_gauges_sum_the_workers():
    """Each host-tier figure is its key summed over the workers; device hits are the hits less the host's."""
    from services.gateway.http.metrics import GatewayMetrics

    m = GatewayMetrics("m")
    m.set_worker_stats([{"cache": {"host_hit_tokens": 30, "hit_tokens": 100, "bytes_h2d": 5, "load_latency_le": [0.1],
                                   "load_latency_buckets": [1, 2]}, "hicache": {"host_used_tokens": 11}},
                        {"cache": {"host_hit_tokens": 2, "hit_tokens": 10, "load_latency_buckets": [0, 4]},
                         "hicache": {"host_used_tokens": 1, "host_total_tokens": 50}}])
    text = m.render().decode()
    for name, value in (("hicache_host_hit_tokens", 32), ("hicache_device_hit_tokens", 78), ("hicache_h2d_bytes", 5),
                        ("hicache_host_used_tokens", 12), ("hicache_host_total_tokens", 50)):
        assert f'sglang:{name}{{model_name="m"}} {value:.1f}' in text, name
    assert 'sglang:hicache_load_seconds_bucket{le="+Inf",model_name="m"} 7.0' in text


def test_the_in_flight_gauge_in_one_process_and_in_a_pool(monkeypatch, tmp_path):
    """Requests started and ended show in the next scrape; in a pool each start is in the shared files."""
    from services.gateway.http.metrics import GatewayMetrics

    m = GatewayMetrics("m")
    for _ in range(3):
        m.gateway_inflight.inc()
    m.gateway_inflight.dec()
    assert 'sglang:gateway_inflight_reqs{model_name="m"} 2.0' in m.render().decode()
    monkeypatch.setenv("PROMETHEUS_MULTIPROC_DIR", str(tmp_path))
    pooled = GatewayMetrics("m")
    pooled.gateway_inflight.inc()
    assert pooled.gateway_inflight._value.get() == 1.0  # in the pool's file at once


def test_generation_result_text_is_joined_once_per_read():
    """A long generation's increments are kept as parts and joined when the text is read: the same text,
    without copying the whole output at every increment."""
    from services.gateway.routing.dispatch import GenerationResult
    from shared.protocol import TokenOutput

    res = GenerationResult(rid="r")
    pieces = [f"t{i} " for i in range(5000)] + [""]
    for p in pieces:
        res.absorb(TokenOutput(rid="r", token_ids=[1], text=p, finished=False))
    assert len(res._text_parts) == 5000
    assert res.text == "".join(pieces) and len(res._text_parts) == 1
    res.absorb(TokenOutput(rid="r", token_ids=[2], text="end", finished=True))
    assert res.text.endswith("t4999 end") and res.completion_tokens == 5002
