"""PD disaggregation for real: `launch --topology pd` starts a prefill and a decode worker process; every
prompt's KV crosses between them over UCX (ucxx). What must hold: the output is exactly the unified
stack's (same model, greedy and seeded), both radix trees are used (the prefill side's hit is reported
as cached tokens, the decode side's hit shrinks the transfer), and failures end requests with clear
errors without leaking KV slots on either side."""
from __future__ import annotations

import asyncio
import concurrent.futures as cf
import json
import os
import random
import signal
import time

import pytest
import requests

from tests.support.stack import Stack, free_port, kill_groups, spawn, wait_for, wait_line

pytestmark = pytest.mark.e2e

GREEDY = {"temperature": 0, "max_new_tokens": 12, "ignore_eos": True}


@pytest.fixture(scope="module")
def pd(pd_stack):
    return pd_stack


def generate(url: str, **body) -> dict:
    r = requests.post(url + "/generate", json=body, timeout=60)
    assert r.status_code == 200, r.text
    return r.json()


def worker_infos(url: str) -> dict[str, dict]:
    return {w["info"]["role"]: w["info"] for w in requests.get(url + "/server_info", timeout=10).json()["workers"]
            if w["info"]}


def test_pd_workers_run_on_uvloop(pd):
    """UCX's asyncio integration (ucxx) runs under uvloop on both PD roles: every PD test here exercises it."""
    assert {role: info["event_loop"].split(".")[0] for role, info in worker_infos(pd.url).items()} == \
        {"prefill": "uvloop", "decode": "uvloop"}


def assert_no_kv_held(url: str) -> None:
    """Every slot is free or evictable on every worker: nothing leaked."""
    def settled():
        infos = worker_infos(url)
        return all(i["num_running"] == 0 and i["kv_usage"] == 0.0 for i in infos.values()) and infos
    wait_for(settled, 20, "all KV released")


def test_pd_output_equals_unified(pd, stack):
    # Counters are per stack (shared with other tests, e.g. the load test): look at this test's share.
    failures_before = worker_infos(pd.url)["decode"]["kv_transfer"]["failures"]
    texts = [f"Request {i}: the quick brown fox jumps over the lazy dog " * (1 + i % 3) for i in range(6)]
    for t in texts:
        for sampling in (GREEDY, {"temperature": 0.8, "top_p": 0.9, "seed": 5, "max_new_tokens": 10}):
            a = generate(pd.url, text=t, sampling_params=sampling)
            b = generate(stack.url, text=t, sampling_params=sampling)
            assert a["output_ids"] == b["output_ids"] and a["text"] == b["text"]
    infos = worker_infos(pd.url)
    assert set(infos) == {"prefill", "decode"}
    sent = infos["prefill"]["kv_transfer"]
    assert sent["sent_tokens"] > 0 and 0 <= sent["late_handshakes"] <= sent["transfers"]
    assert sent["endpoint_reuses"] > 0 and sent["connects"] < sent["transfers"]  # endpoints are kept
    assert infos["decode"]["kv_transfer"]["received_tokens"] > 0
    assert infos["decode"]["kv_transfer"]["failures"] == failures_before


def test_pd_first_token_edge_cases(pd, stack):
    t = "Edge cases of the first token, which the prefill worker samples."
    one = generate(pd.url, text=t, sampling_params={**GREEDY, "max_new_tokens": 1})
    assert one["meta_info"]["completion_tokens"] == 1
    ref_one = generate(stack.url, text=t, sampling_params={**GREEDY, "max_new_tokens": 1})
    assert one["output_ids"] == ref_one["output_ids"]
    hint = generate(pd.url, text=t + " hint", sampling_params={"max_new_tokens": 0})
    assert hint["output_ids"] == [] and hint["meta_info"]["finish_reason"]["type"] == "length"
    ref = generate(stack.url, text=t, sampling_params=GREEDY)
    stop_id = ref["output_ids"][0]
    r = generate(pd.url, text=t, sampling_params={**GREEDY, "stop_token_ids": [stop_id]})
    assert r["output_ids"] == [stop_id] and r["meta_info"]["finish_reason"]["type"] == "stop"
    # Constrained: the prefill side samples the first token under the grammar, the decode side goes on.
    rx = {"temperature": 0, "max_new_tokens": 16, "regex": "(yes|no), [0-9]{2,3}"}
    a = generate(pd.url, text=t, sampling_params=rx)
    assert a == {**a, "text": generate(stack.url, text=t, sampling_params=rx)["text"]}
    # Input logprobs need the prompt's forward pass where the answer is made: served whole by decode.
    lp = generate(pd.url, text=t, sampling_params={**GREEDY, "max_new_tokens": 2}, return_logprob=True,
                  logprob_start_len=0)
    assert len(lp["meta_info"]["input_token_logprobs"]) == lp["meta_info"]["prompt_tokens"]
    assert_no_kv_held(pd.url)


def test_pd_streaming_and_openai_usage(pd, stack):
    body = {"model": "tiny-random", "prompt": "Stream me some tokens", "max_tokens": 10, "temperature": 0,
            "stream": True, "stream_options": {"include_usage": True}}
    with requests.post(pd.url + "/v1/completions", json=body, stream=True, timeout=60) as r:
        events = [json.loads(line[6:]) for line in r.iter_lines()
                  if line.startswith(b"data: ") and line != b"data: [DONE]"]
    text = "".join(c["text"] for e in events for c in e["choices"])
    ref = requests.post(stack.url + "/v1/completions", json={**body, "stream": False}, timeout=60).json()
    assert text == ref["choices"][0]["text"]
    assert events[-1]["usage"]["completion_tokens"] == 10


def test_pd_reuses_both_trees(pd):
    base = "A long shared system prompt that many requests start with. " * 4
    first = generate(pd.url, text=base + "Question one?", sampling_params=GREEDY)
    before = worker_infos(pd.url)["decode"]["kv_transfer"]
    # A long new tail (more than the gateway's --pd-bypass-tokens): it goes through the prefill worker.
    second = generate(pd.url, text=base + "Question two? " * 40, sampling_params=GREEDY)
    after = worker_infos(pd.url)["decode"]["kv_transfer"]
    assert first["meta_info"]["cached_tokens"] < 50
    # The prefill worker's tree held the shared head.
    assert second["meta_info"]["cached_tokens"] >= 50, second["meta_info"]
    # The decode worker's tree held it too: only the new tail crossed the wire.
    sent = after["received_tokens"] - before["received_tokens"]
    assert after["skipped_tokens"] - before["skipped_tokens"] >= 50
    assert sent < second["meta_info"]["prompt_tokens"] - 50


def test_pd_concurrent_requests_match_unified_and_release_everything(pd, stack):
    texts = [f"Concurrent {i} " + "lorem ipsum " * (i % 5 + 1) for i in range(16)]

    def both(t):
        return (generate(pd.url, text=t, sampling_params=GREEDY)["output_ids"],
                generate(stack.url, text=t, sampling_params=GREEDY)["output_ids"])
    with cf.ThreadPoolExecutor(16) as ex:
        for a, b in ex.map(both, texts):
            assert a == b
    assert_no_kv_held(pd.url)


def test_pd_client_disconnect_aborts_both_sides(pd):
    body = {"text": "disconnect me", "stream": True, "sampling_params": {"max_new_tokens": 3000, "ignore_eos": True}}
    with requests.post(pd.url + "/generate", json=body, stream=True, timeout=60) as r:
        next(line for line in r.iter_lines() if line.startswith(b"data: "))
    assert_no_kv_held(pd.url)


@pytest.mark.parametrize("remote", [False, True])
def test_lm_programs_run_on_pd(pd, stack, remote):
    """The judge program (select = input logprobs, run whole on decode; fork hints = max_new_tokens 0
    through PD; a regex gen) gives the unified stack's answers, in interpreter mode and server-side."""
    from lang_client import RuntimeEndpoint
    from lang_client.examples.branch_solve_merge import multi_dimensional_judge

    essay = "Trees cool cities and cut energy use in summer."
    a = multi_dimensional_judge.run(essay=essay, remote=remote, backend=RuntimeEndpoint(pd.url), temperature=0)
    b = multi_dimensional_judge.run(essay=essay, remote=remote, backend=RuntimeEndpoint(stack.url), temperature=0)
    for name in ("on_topic", "summary", "grade"):
        assert a[name] == b[name], name
    assert_no_kv_held(pd.url)


def start_pd_pool(prefills: int = 1, decodes: int = 1, prefill_args: tuple[str, ...] = (),
                  decode_args: tuple[str, ...] = ()):
    """Prefill and decode worker processes (each with its extra flags) behind a gateway: (prefill processes,
    decode processes, gateway, url). Whatever started is stopped if the rest does not come up."""
    ps = [spawn("services.prefill", "--model-path", "tiny-random", *prefill_args) for _ in range(prefills)]
    ds = [spawn("services.decode", "--model-path", "tiny-random", "--kv-transfer-timeout", "8", *decode_args)
          for _ in range(decodes)]
    procs = [*ps, *ds]
    try:
        addrs = [wait_line(p, "WORKER READY").split()[2] for p in procs]
        port = free_port()
        procs.append(spawn("services.gateway", "--model-path", "tiny-random", "--workers", ",".join(addrs),
                           "--port", str(port)))
        wait_line(procs[-1], "gateway ready")
        url = f"http://127.0.0.1:{port}"
        wait_for(lambda: requests.get(url + "/health", timeout=5).status_code == 200, 60, "health")
    except BaseException:
        kill_groups(*procs)
        raise
    return ps, ds, procs[-1], url


def start_pd_processes(prefill_args: tuple[str, ...] = (), decode_args: tuple[str, ...] = ()):
    """One prefill and one decode worker behind a gateway: (prefill, decode, gateway, url)."""
    (prefill,), (decode,), gateway, url = start_pd_pool(1, 1, prefill_args, decode_args)
    return prefill, decode, gateway, url


def test_prefill_worker_killed_before_the_hand_over_the_decode_worker_computes_the_prompt(stack):
    prefill, decode, gateway, url = start_pd_processes()
    try:
        assert generate(url, text="warm", sampling_params=GREEDY)["meta_info"]["completion_tokens"] == 12
        os.killpg(prefill.pid, signal.SIGSTOP)  # accepted requests now wait on a prefill that never comes
        text = "stuck " * 40
        with cf.ThreadPoolExecutor(1) as ex:
            fut = ex.submit(requests.post, url + "/generate", json={"text": text, "sampling_params": GREEDY},
                            timeout=60)
            time.sleep(1.0)
            os.killpg(prefill.pid, signal.SIGKILL)
            t0 = time.monotonic()
            r = fut.result()
        # Nothing lost: the decode worker computed the prompt itself, with the unified stack's answer.
        assert r.status_code == 200, r.text
        assert r.json()["output_ids"] == generate(stack.url, text=text, sampling_params=GREEDY)["output_ids"]
        assert time.monotonic() - t0 < 15
        assert gateway_counter(url, "num_pd_retried_requests") >= 1
        assert_no_kv_held(url)
        # With no prefill worker left, the decode worker serves requests whole.
        r = requests.post(url + "/generate", json={"text": "still served", "sampling_params": GREEDY}, timeout=60)
        assert r.status_code == 200 and r.json()["meta_info"]["completion_tokens"] == 12
    finally:
        kill_groups(prefill, decode, gateway)


def gateway_counter(url: str, name: str) -> float:
    text = requests.get(url + "/metrics", timeout=10).text
    return sum(float(line.rsplit(" ", 1)[1]) for line in text.splitlines()
               if line.startswith(f"sglang:{name}_total"))


def test_decode_worker_dying_before_the_first_token_the_request_moves_to_another(stack):
    """1 prefill : 2 decode. Requests routed to a decode worker that dies before their first token are
    retried on the other one (the prefill worker's tree still holds their prompts): all succeed."""
    prefills, decodes, gateway, url = start_pd_pool(1, 2)
    procs = [*prefills, *decodes, gateway]
    try:
        texts = [f"Retry me {i}: " + "words to prefill " * (2 + i % 3) for i in range(8)]
        os.killpg(decodes[0].pid, signal.SIGSTOP)  # requests routed to it wait for their handshake
        with cf.ThreadPoolExecutor(8) as ex:
            futs = [ex.submit(requests.post, url + "/generate", json={"text": t, "sampling_params": GREEDY},
                              timeout=60) for t in texts]
            time.sleep(1.5)
            os.killpg(decodes[0].pid, signal.SIGKILL)
            results = [f.result() for f in futs]
        for t, r in zip(texts, results):
            assert r.status_code == 200, r.text
            assert r.json()["output_ids"] == generate(stack.url, text=t, sampling_params=GREEDY)["output_ids"]
        assert gateway_counter(url, "num_pd_retried_requests") >= 1  # some had gone to the dead one
        infos = {w["info"]["role"]: w["info"] for w in requests.get(url + "/server_info", timeout=10).json()["workers"]
                 if w["info"]}
        assert infos["prefill"]["kv_usage"] == 0.0 and infos["prefill"]["kv_transfer"]["in_flight"] == 0
    finally:
        kill_groups(*procs)


def test_prefill_worker_dying_its_requests_move_to_another_prefill_worker(stack):
    """2 prefill : 1 decode. Requests waiting on a prefill worker that dies are computed by the other
    prefill worker (not the decode worker, which has one to pair with): all succeed, unified's output."""
    prefills, decodes, gateway, url = start_pd_pool(2, 1)
    procs = [*prefills, *decodes, gateway]
    try:
        texts = [f"Prefill dies {i}: " + "words to prefill " * (2 + i % 3) for i in range(8)]
        os.killpg(prefills[0].pid, signal.SIGSTOP)
        with cf.ThreadPoolExecutor(8) as ex:
            futs = [ex.submit(requests.post, url + "/generate", json={"text": t, "sampling_params": GREEDY},
                              timeout=60) for t in texts]
            time.sleep(1.5)
            os.killpg(prefills[0].pid, signal.SIGKILL)
            results = [f.result() for f in futs]
        for t, r in zip(texts, results):
            assert r.status_code == 200, r.text
            assert r.json()["output_ids"] == generate(stack.url, text=t, sampling_params=GREEDY)["output_ids"]
        retried = gateway_counter(url, "num_pd_retried_requests")
        assert retried >= 1  # some had gone to the stopped one
        infos = worker_infos(url)
        assert infos["prefill"]["kv_transfer"]["transfers"] >= len(texts)  # the survivor computed them all
        assert_no_kv_held(url)
    finally:
        kill_groups(*procs)


def test_next_chat_turn_bypasses_the_prefill_worker(pd, stack):
    """A conversation's next turn extends what the decode worker's tree holds (the last prompt and its
    answer) by a short suffix: the gateway sends it to that decode worker alone. No KV transfer, the
    unified stack's output, the history reported as cached."""
    from shared.tokenizer import Tokenizer

    tok = Tokenizer.load("tiny-random")
    ids = tok.encode("System: you are a helpful assistant who answers briefly. " * 3 + "User: hello there")
    sampling = {**GREEDY, "max_new_tokens": 20}
    first = generate(pd.url, input_ids=ids, sampling_params=sampling)
    for turn in range(2):
        ids = ids + first["output_ids"] + tok.encode(f" User: and turn {turn}?")
        before = worker_infos(pd.url)["prefill"]["kv_transfer"]["transfers"]
        bypassed = gateway_counter(pd.url, "num_pd_bypassed_requests")
        out = generate(pd.url, input_ids=ids, sampling_params=sampling)
        assert worker_infos(pd.url)["prefill"]["kv_transfer"]["transfers"] == before  # no transfer
        assert gateway_counter(pd.url, "num_pd_bypassed_requests") == bypassed + 1
        assert out["output_ids"] == generate(stack.url, input_ids=ids, sampling_params=sampling)["output_ids"]
        assert out["meta_info"]["cached_tokens"] >= len(ids) - 32  # the decode worker's tree held the history
        first = out
    # A turn with a long new suffix goes through the prefill worker again.
    ids = ids + first["output_ids"] + tok.encode(" User: " + "a much longer question " * 40)
    before = worker_infos(pd.url)["prefill"]["kv_transfer"]["transfers"]
    out = generate(pd.url, input_ids=ids, sampling_params=sampling)
    assert out["output_ids"] == generate(stack.url, input_ids=ids, sampling_params=sampling)["output_ids"]
    assert worker_infos(pd.url)["prefill"]["kv_transfer"]["transfers"] == before + 1
    assert_no_kv_held(pd.url)


async def _decode_worker_scenario(host: str, port: int) -> None:
    from shared.protocol import GenerateRequest, Hello, InfoRequest, Transfer
    from shared.sampling_params import SamplingParams
    from shared.wire import encode_frame, read_message

    reader, writer = await asyncio.open_connection(host, port)
    writer.write(encode_frame(Hello()))

    async def ask(req) -> list:
        writer.write(encode_frame(req))
        outs = []
        while not outs or not outs[-1].finished:
            outs.extend((await asyncio.wait_for(read_message(reader), 30)).outputs)
        return outs

    bad = [(Transfer(role="prefill", id="t1", host="127.0.0.1", port=1), "does not send KV"),
           (Transfer(role="decode", id=""), "transfer.id"), (Transfer(role="elsewhere", id="t2"), "transfer.role")]
    for i, (transfer, message) in enumerate(bad):
        outs = await ask(GenerateRequest(rid=f"bad{i}", input_ids=[5, 6, 7],
                                         sampling=SamplingParams(max_new_tokens=2), transfer=transfer))
        assert message in (outs[-1].error or ""), outs[-1]
    # Slots reserved for pages that never come are given back after --kv-transfer-timeout.
    t0 = time.monotonic()
    outs = await ask(GenerateRequest(rid="orphan", input_ids=list(range(5, 60)),
                                     sampling=SamplingParams(max_new_tokens=2),
                                     transfer=Transfer(role="decode", id="never")))
    assert "did not arrive" in (outs[-1].error or ""), outs[-1]
    assert 1.5 < time.monotonic() - t0 < 15
    writer.write(encode_frame(InfoRequest(call_id=9)))
    info = (await asyncio.wait_for(read_message(reader), 10)).info
    assert info["num_running"] == 0 and info["kv_usage"] == 0.0
    writer.close()


def test_decode_worker_refuses_bad_transfers_and_times_out_missing_pages():
    proc = spawn("services.decode", "--model-path", "tiny-random", "--kv-transfer-timeout", "2")
    try:
        host, port = wait_line(proc, "WORKER READY").split()[2].rsplit(":", 1)
        asyncio.run(_decode_worker_scenario(host, int(port)))
    finally:
        kill_groups(proc)


def test_decode_worker_killed_mid_stream_ends_the_stream_and_prefill_keeps_serving():
    prefill, decode, gateway, url = start_pd_processes()
    try:
        body = {"text": "long stream", "stream": True, "sampling_params": {"max_new_tokens": 4000, "ignore_eos": True}}
        with requests.post(url + "/generate", json=body, stream=True, timeout=60) as resp:
            lines = resp.iter_lines()
            next(line for line in lines if line.startswith(b"data: "))
            os.killpg(decode.pid, signal.SIGKILL)
            t0 = time.monotonic()
            rest = [json.loads(line[6:]) for line in lines if line.startswith(b"data: ") and line != b"data: [DONE]"]
        assert time.monotonic() - t0 < 15
        assert "error" in rest[-1], rest[-1]
        # No decode worker: nothing can serve a whole request (prefill workers never decode) -> 503.
        r = requests.post(url + "/generate", json={"text": "x", "sampling_params": GREEDY}, timeout=30)
        assert r.status_code == 503 and "error" in r.json()
        info = next(w["info"] for w in requests.get(url + "/server_info", timeout=10).json()["workers"]
                    if w["info"] and w["info"]["role"] == "prefill")
        assert info["num_running"] == 0 and info["kv_usage"] == 0.0 and info["kv_transfer"]["in_flight"] == 0
    finally:
        kill_groups(prefill, decode, gateway)


def test_pd_under_memory_pressure_queues_instead_of_failing_and_leaks_nothing():
    """A decode pool that holds only a few prompts at a time: reservations wait for room (and evict the
    tree), requests queue on both sides, all finish with the unified stack's output."""
    s = Stack("--topology", "pd", "--max-total-tokens", "1200")
    try:
        texts = [f"Pressure {i}: " + "tokens to fill the pool " * 12 for i in range(12)]
        with cf.ThreadPoolExecutor(12) as ex:
            outs = list(ex.map(lambda t: generate(s.url, text=t, sampling_params=GREEDY)["output_ids"], texts))
        assert all(len(o) == 12 for o in outs)
        assert outs[3] == generate(s.url, text=texts[3], sampling_params=GREEDY)["output_ids"]
        assert_no_kv_held(s.url)
    finally:
        s.stop()


def test_restarted_decode_worker_gets_a_fresh_endpoint_and_requests_keep_working():
    """The prefill side keeps UCX endpoints for reuse; after the decode worker restarts on the same
    address, the kept one is stale: the handshake is retried on a new connection, no request fails."""
    dport, tport = free_port(), free_port()
    decode_args = ("services.decode", "--model-path", "tiny-random", "--port", str(dport),
                   "--transfer-port", str(tport))
    prefill = spawn("services.prefill", "--model-path", "tiny-random")
    decode = spawn(*decode_args)
    procs = [prefill, decode]
    try:
        paddr = wait_line(prefill, "WORKER READY").split()[2]
        wait_line(decode, "WORKER READY")
        port = free_port()
        gateway = spawn("services.gateway", "--model-path", "tiny-random", "--workers", f"{paddr},127.0.0.1:{dport}",
                        "--port", str(port))
        procs.append(gateway)
        wait_line(gateway, "gateway ready")
        url = f"http://127.0.0.1:{port}"
        wait_for(lambda: requests.get(url + "/health", timeout=5).status_code == 200, 60, "health")
        assert generate(url, text="before the restart", sampling_params=GREEDY)["meta_info"]["completion_tokens"] == 12
        os.killpg(decode.pid, signal.SIGKILL)
        decode.wait()
        decode = spawn(*decode_args)
        procs.append(decode)
        wait_line(decode, "WORKER READY")
        wait_for(lambda: requests.get(url + "/health", timeout=5).status_code == 200, 60, "health again")
        for i in range(3):
            r = requests.post(url + "/generate", json={"text": f"after {i}", "sampling_params": GREEDY}, timeout=60)
            assert r.status_code == 200 and r.json()["meta_info"]["completion_tokens"] == 12, r.text
        info = next(w["info"] for w in requests.get(url + "/server_info", timeout=10).json()["workers"]
                    if w["info"] and w["info"]["role"] == "prefill")
        assert info["kv_transfer"]["connects"] >= 2  # the stale endpoint was replaced
    finally:
        kill_groups(*procs)


def test_pd_with_the_host_tier_on_both_sides():
    """The host KV tier on a prefill and a decode worker, each with a 128-token device pool: prompts evicted from
    both come back from the host tiers (a decode-side load before its transfer is reserved), the answers are an
    engine's with room for everything, and neither side keeps a slot the tree does not hold; a flush empties all."""
    from tests.support.engine_harness import Harness

    tier = ("--max-total-tokens", "128", "--enable-hierarchical-cache", "--hicache-ratio", "4", "--dtype", "float32")
    prefill, decode, gateway, url = start_pd_processes(tier + ("--hicache-write-policy", "write_back"), tier)
    try:
        rng = random.Random(1)
        prompts = [[rng.randrange(5, 400) for _ in range(100)] for _ in range(3)]
        sampling = {"max_new_tokens": 4, "temperature": 0, "ignore_eos": True}
        ref = Harness()
        for p in prompts + prompts[::-1]:
            out = generate(url, input_ids=p, sampling_params=sampling)
            assert out["output_ids"] == ref.generate(p, sampling=sampling)["ids"]
        infos = worker_infos(url)
        assert infos["decode"]["cache"]["host_hit_tokens"] >= 90
        assert [infos[r]["hicache"]["write_policy"] for r in ("prefill", "decode")] == ["write_back", "write_through"]

        def settled():
            return all(i["num_running"] == 0 and i["hicache"]["device_used_tokens"] == i["cache"]["cached_tokens"]
                       and i["hicache"]["host_used_tokens"] == i["cache"]["host_cached_tokens"]
                       for i in worker_infos(url).values())

        wait_for(settled, 10, "both pools of both workers as their trees hold them")
        assert requests.post(url + "/flush_cache", timeout=30).status_code == 200
        assert all(i["hicache"]["device_used_tokens"] == i["hicache"]["host_used_tokens"] == 0
                   for i in worker_infos(url).values())
    finally:
        kill_groups(prefill, decode, gateway)
