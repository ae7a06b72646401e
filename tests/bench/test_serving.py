"""bench/serving.py's datasets and summary (the GPU run is where its numbers come from; these keep the
parts that decide what it measures honest)."""
from __future__ import annotations

import contextlib
import subprocess
import sys

import pytest

from bench.serving import gsp_dataset, ideal_hit_rate, random_dataset, sharegpt_dataset, summarize


def test_random_dataset_lengths_within_range():
    data = random_dataset(50, 100, 20, 0.5, seed=1)
    assert len(data) == 50
    assert all(50 <= len(ids) <= 100 and 10 <= ol <= 20 for ids, ol in data)
    assert random_dataset(50, 100, 20, 0.5, seed=1) == data  # fixed seed


def test_gsp_ideal_hit_rate_is_the_shared_system_prompts():
    groups, per, sys_len, q_len = 4, 5, 100, 10
    data = gsp_dataset(groups, per, sys_len, q_len, 8)
    assert len(data) == groups * per
    assert [d[0][:sys_len] for d in data[:groups]] != [data[0][0][:sys_len]] * groups  # interleaved groups
    want = groups * (per - 1) * sys_len / (groups * per * (sys_len + q_len))
    assert abs(ideal_hit_rate(data) - want) < 0.01


def test_sharegpt_turns_extend_their_history():
    data = sharegpt_dataset(40, seed=3)
    assert len(data) == 40
    later = [(a, b) for a, b in zip(data, data[1:]) if len(b[0]) > len(a[0]) and b[0][:len(a[0])] == a[0]]
    assert later, "some requests must be a conversation's next turn"
    assert ideal_hit_rate(data) > 0.2


def test_summary_percentiles_and_errors():
    results = [{"ttft": 0.1 * i, "e2e": 0.1 * i + 1.0, "itl": [0.01] * 9, "out": 10, "in": 5} for i in range(1, 11)]
    results.append({"error": "503: busy"})
    s = summarize(results, wall=2.0)
    assert s["completed"] == 10 and s["errors"] == 1 and s["out_tok_s"] == 50.0
    assert abs(s["ttft_p50_ms"] - 600) < 1e-6 and abs(s["itl_p99_ms"] - 10) < 1e-6
    assert abs(s["tpot_p50_ms"] - 1000 / 9) < 1e-6


@pytest.mark.e2e
def test_serving_bench_runs_end_to_end_with_batch1(tmp_path):
    """bench/serving.py --launch on the tiny shape: a real stack, the offline reference and the batch-1
    comparison each print their verdict line (the numbers mean something only on the GPU)."""
    import json
    import subprocess
    import sys

    from tests.support.stack import ROOT, free_port

    r = subprocess.run([sys.executable, "-m", "bench.serving", "--launch", "--shape", "tiny", "--num-prompts", "6",
                        "--random-input-len", "24", "--random-output-len", "6", "--routes", "generate",
                        "--offline", "--batch1", "2", "--port", str(free_port()), "--out", str(tmp_path)],
                       cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stdout[-2000:] + r.stderr[-2000:]
    assert "generate at " in r.stdout and "of the offline engine" in r.stdout, r.stdout
    assert "generate batch-1 TPOT p50" in r.stdout and "engine's batch-1 step" in r.stdout, r.stdout
    res = json.loads((tmp_path / "serving_random.json").read_text())
    assert res["runs"]["generate"]["completed"] == 6 and res["runs"]["generate batch-1"]["completed"] == 2
    assert res["offline"]["batch1_step_ms"] > 0
    # Client and worker share this host's monotonic clock: the run's wall splits into arrival, the
    # engine's one busy period and the tail, each non-negative and together the run's extent.
    e = res["runs"]["generate"]["edges"]
    assert e["ordered"] and e["busy_periods"] >= 1 and e["arrival_ms"] >= 0 and e["tail_ms"] >= 0, e
    assert e["engine_span_s"] * 1e3 + e["arrival_ms"] + e["tail_ms"] <= res["runs"]["generate"]["wall_s"] * 1e3 + 1, e
    assert "edges: first send -> first launch" in r.stdout, r.stdout
    assert res["offline"]["engine_span_s"] > 0


def test_openai_stream_count_takes_the_usage_chunk():
    """Events may carry several tokens (a stream that fell behind): the final usage chunk is the count."""
    from bench.serving import _count, request_body

    assert request_body("completions", [1, 2], 4, True)[1]["stream_options"] == {"include_usage": True}
    n = _count("completions", {"choices": [{"text": "a b c"}]}, 0)
    assert n == 1
    assert _count("completions", {"choices": [], "usage": {"completion_tokens": 3}}, n) == 3


def test_stack_pids_counts_a_pools_gateway_processes_as_gateway():
    """The gateway's CPU per token sums the launcher and, with --gateway-processes N, its gateway children
    (they carry --process-index); workers carry --role; anything else is neither."""
    import os
    import subprocess
    import sys

    from bench.serving import stack_pids
    nap = "import time; time.sleep(60)"
    kids = [subprocess.Popen([sys.executable, "-c", nap, *args])
            for args in (["--process-index", "0"], ["--process-index", "1"], ["--role", "unified"], [])]
    try:
        pids = stack_pids(os.getpid())  # other tests' session stacks may be children too
        gateway, workers = set(pids["gateway"]), set(pids["workers"])
        assert pids["gateway"][0] == os.getpid()
        assert {kids[0].pid, kids[1].pid} <= gateway and kids[2].pid not in gateway
        assert kids[2].pid in workers and not {kids[0].pid, kids[1].pid, kids[3].pid} & workers
        assert kids[3].pid not in gateway
    finally:
        for k in kids:
            k.kill()
            k.wait()


def test_cpu_snapshot_resolves_less_than_a_clock_tick():
    """The gateway's us/token comes from these totals: 4 ms of CPU must read as ~4 ms, not as 0 or 10 ms
    (the ticks of /proc/PID/stat quantize a 32k-token run's gateway time to +-0.3 us/token). Measured on
    a child that spins 4 ms then blocks, as a server's threads do between events (a thread's schedstat
    is brought up to date when it leaves the CPU, so the running test process cannot read itself)."""
    import subprocess
    import sys

    from bench.serving import cpu_snapshot
    spin = ("import sys, time\n"
            "sys.stdin.readline()\n"
            "t0 = time.thread_time()\n"
            "while time.thread_time() - t0 < 0.004:\n"
            "    pass\n"
            "print('spun', flush=True)\n"
            "sys.stdin.readline()\n")
    child = subprocess.Popen([sys.executable, "-c", spin], stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
    try:
        pids = {"gateway": [child.pid]}
        import time
        time.sleep(0.3)  # started and blocked on its first read
        before = cpu_snapshot(pids)
        child.stdin.write("\n")
        child.stdin.flush()
        assert child.stdout.readline().strip() == "spun"
        time.sleep(0.05)  # blocked on its second read
        spent = cpu_snapshot(pids)["gateway"] - before["gateway"]
        assert 0.0035 <= spent < 0.009, spent
    finally:
        child.kill()
        child.wait()


@contextlib.asynccontextmanager
async def _test_server(routes):
    """An aiohttp server on a free port with (method, path, handler) routes; yields its URL."""
    from aiohttp import web

    app = web.Application()
    for method, path, handler in routes:
        app.router.add_route(method, path, handler)
    runner = web.AppRunner(app)
    await runner.setup()
    site = web.TCPSite(runner, "127.0.0.1", 0)
    await site.start()
    try:
        yield f"http://127.0.0.1:{site._server.sockets[0].getsockname()[1]}"
    finally:
        await runner.cleanup()


def test_run_load_sends_prepared_bodies_and_restores_the_collector():
    """run_load encodes every body before the clock starts and keeps the cyclic collector off the run's
    objects; afterwards the process's collector is as it was (thresholds, nothing left frozen)."""
    import asyncio
    import gc
    import math

    from aiohttp import web

    from bench.serving import run_load

    seen = []

    async def generate(request):
        body = await request.json()
        seen.append((request.content_type, len(body["input_ids"])))
        return web.json_response({"text": "x", "meta_info": {"completion_tokens": 3}})

    async def main():
        async with _test_server([("POST", "/generate", generate)]) as url:
            return await run_load(url, "generate", [([1, 2, 3], 3)] * 5 + [([4], 3)], False, math.inf, 0)

    before = gc.get_threshold()
    results, wall = asyncio.run(main())
    assert gc.get_threshold() == before and gc.get_freeze_count() == 0
    assert [r["out"] for r in results] == [3] * 6 and [r["in"] for r in results] == [3] * 5 + [1]
    assert sorted(seen) == sorted([("application/json", 3)] * 5 + [("application/json", 1)])
    assert all(r["t_start"] <= r["t_end"] for r in results) and wall > 0


def test_thread_cpu_names_the_main_thread_and_counts_a_busy_one():
    import os
    import threading
    import time

    from shared import procfs

    spun, done = threading.Event(), threading.Event()

    def spin():  # 0.2 s of this thread's own CPU time, however loaded the machine (a wall-clock spin got 0.14 s
        # of CPU on a busy 2-core box)
        while time.thread_time() < 0.2:
            pass
        spun.set()
        done.wait()

    th = threading.Thread(target=spin)
    th.start()
    try:
        assert spun.wait(60)
        got = procfs.thread_run_seconds(os.getpid())
        assert f"main/{os.getpid()}" in got, got
        assert f"python/{th.native_id}" in got or any(k.endswith(f"/{th.native_id}") for k in got)
        assert max(v for k, v in got.items() if k.endswith(f"/{th.native_id}")) >= 0.15
    finally:
        done.set()
        th.join()


def test_edges_split_the_wall_around_the_busy_period():
    from bench.serving import edges

    results = [{"t_start": 10.0, "t_end": 15.0}, {"t_start": 10.02, "t_end": 15.2}, {"error": "x"}]
    e = edges(results, {"start": 10.1, "end": 15.19, "count": 3}, periods0=2)
    assert e["ordered"] and e["busy_periods"] == 1
    assert abs(e["arrival_ms"] - 100) < 1e-6 and abs(e["tail_ms"] - 10) < 1e-6
    assert abs(e["send_spread_ms"] - 20) < 1e-6 and abs(e["engine_span_s"] - 5.09) < 1e-9
    # A busy period from before the run (or another host's clock) is flagged, not taken for edges.
    assert not edges(results, {"start": 9.0, "end": 9.5, "count": 3}, periods0=3)["ordered"]
    assert edges(results, None) == {} and edges([{"error": "x"}], {"start": 1, "end": 2}) == {}


def test_attention_backend_is_checked_before_anything_starts():
    """--attention-backend reaches the servers and the offline engine; flashinfer without its package is refused at
    once, naming the install command."""
    import importlib.util

    if importlib.util.find_spec("flashinfer") is not None:
        pytest.skip("flashinfer is installed here")
    run = subprocess.run([sys.executable, "-m", "bench.serving", "--attention-backend", "flashinfer"],
                         capture_output=True, text=True, timeout=60)
    assert run.returncode == 2 and "flashinfer-python" in run.stderr
