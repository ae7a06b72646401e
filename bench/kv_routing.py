"""`python -m bench.kv_routing`: cache-aware routing on the workers' KV events (the exact index) against each
gateway process's own approximate index, through the real services: tiny-random workers on the CPU, a
private redis-server on a free port, gateways started and stopped per phase.

Phases (one run each), and the goal each checks:
  hit rate     multi-turn chats over the workers, round-robin through 2 gateways vs 1: prefix hit rate
               ratio >= 0.98 on the exact index (the approximate index's ratio is reported too);
  lag, cost    the hit-rate chats 3x over through 2 gateways: event lag p99 <= 50 ms (every gateway's index,
               ~400 batches each); publishing <= 1% of the worker's step time;
  eviction     conversations whose histories are 3x the workers' pools, turn by turn (each comes back after
               all the others went through the pools): routed-for-cache requests whose worker had dropped the
               promised prefix before the gateway's pick (the worker's event time of the first missing block's
               removal vs the pick's) <= 1% on the exact index; one dropped after the pick, while the request
               queued, is counted apart. The approximate index routes the same workload with the KV events
               followed only to audit it ($RADIXSERVE_KV_INDEX_ROUTING=0); its rate is printed beside;
  new gateway  a gateway started on a warm fleet routes on the full picture within 1 s of being ready;
  outage       redis-server killed under load and restarted empty: no request fails, every gateway's index
               resynced within 2 s of its return.
Prints each figure, PASS/FAIL per goal, and the figures as one JSON line last.
"""
from __future__ import annotations

import argparse
import asyncio
import json
import os
import random
import shutil
import signal
import socket
import subprocess
import sys
import threading
import time

import aiohttp
import requests

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
KEY = "bench-internal-key"


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def spawn(*args: str, env: dict | None = None) -> subprocess.Popen:
    """A service, as services.launch starts one: in a process group of its own (`stop` kills the group) and
    in this session, which is one CPU scheduling group (services/supervisor.py says why)."""
    # One compute thread per CPU worker, as one worker is one device: torch's default of one per core makes
    # 4 workers x 2 threads contend for 2 cores, and the lag's tail measured the contention, not the path.
    env = dict(os.environ, RADIXSERVE_INTERNAL_KEY=KEY, PYTHONPATH=ROOT, OMP_NUM_THREADS="1", **(env or {}))
    return subprocess.Popen([sys.executable, "-m", *args], cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                            text=True, process_group=0, env=env)


def wait_line(proc: subprocess.Popen, prefix: str, timeout: float = 180) -> str:
    """The first output line holding `prefix`; the rest of the output is drained on a thread (a full pipe
    would block the process)."""
    deadline = time.monotonic() + timeout
    for line in proc.stdout:
        if prefix in line:
            threading.Thread(target=proc.stdout.read, daemon=True).start()
            return line
        if time.monotonic() > deadline:
            break
    raise RuntimeError(f"no {prefix!r} from the process (exit code {proc.poll()})")


def stop(*procs: subprocess.Popen) -> None:
    """SIGKILL to each live process's group (each runs in a group of its own), then reap it."""
    for p in (p for p in procs if p.poll() is None):
        os.killpg(p.pid, signal.SIGKILL)
        p.wait()


class Redis:
    def __init__(self):
        self.port = free_port()
        self.url = f"redis://127.0.0.1:{self.port}/0"
        self.proc = None
        self.start()

    def start(self) -> None:
        self.proc = subprocess.Popen(["redis-server", "--bind", "127.0.0.1", "--port", str(self.port), "--save", "",
                                      "--appendonly", "no"], stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
                                     start_new_session=True)
        for _ in range(200):
            try:
                socket.create_connection(("127.0.0.1", self.port), timeout=0.2).close()
                return
            except OSError:
                time.sleep(0.025)
        raise RuntimeError("redis-server did not start")

    def stop(self) -> None:
        stop(self.proc)


def gateway(*, redis_url: str | None = None, workers: list[str] | None = None,
            env: dict | None = None) -> tuple[subprocess.Popen, str]:
    port = free_port()
    args = ["services.gateway", "--model-path", "tiny-random", "--port", str(port), "--log-level", "warning"]
    args += ["--redis-url", redis_url] if redis_url else ["--workers", ",".join(workers)]
    proc = spawn(*args, env=env)
    wait_line(proc, "gateway ready")
    return proc, f"http://127.0.0.1:{port}"


def info(url: str) -> dict:
    return requests.get(url + "/server_info", timeout=30).json()


def exact(url: str) -> dict:
    return info(url)["routing"].get("exact_index", {})


def wait_until(pred, timeout: float, what: str, interval: float = 0.02) -> float:
    t0 = time.monotonic()
    while time.monotonic() - t0 < timeout:
        try:
            if pred():
                return time.monotonic() - t0
        except requests.RequestException:
            pass
        time.sleep(interval)
    raise TimeoutError(what)


def ready(url: str, n: int, exact_index: bool) -> None:
    def ok():
        i = info(url)
        if sum(w["connected"] for w in i["workers"]) < n:
            return False
        return not exact_index or i["routing"].get("exact_index", {}).get("synced_workers", 0) >= n
    wait_until(ok, 60, "gateway sees every worker")


async def chats(urls: list[str], convs: int, turns: int, seed: int, concurrency: int, user_tokens=(24, 56),
                waves: bool = False) -> dict:
    """Multi-turn conversations sharing a system prompt, each turn sent to the next gateway in turn (round robin
    over every request). `concurrency` conversations at a time, each to its end; with `waves`, turn by turn
    instead: every conversation's turn t (in a shuffled order, `concurrency` requests at a time) before any
    turn t+1, so a conversation comes back after all the others have been through the workers' pools.
    Returns prompt and cached token totals and the failures."""
    rng = random.Random(seed)
    system = [rng.randrange(3, 400) for _ in range(64)]
    users = [[[rng.randrange(3, 400) for _ in range(rng.randrange(*user_tokens))] for _ in range(turns)]
             for _ in range(convs)]
    totals = {"prompt": 0, "cached": 0, "requests": 0, "failed": 0}
    counter = iter(range(1 << 30))
    sem = asyncio.Semaphore(concurrency)
    history = [list(system) for _ in range(convs)]

    async def turn(session, c, t):
        prompt = history[c] + users[c][t]
        url = urls[next(counter) % len(urls)]
        try:
            async with session.post(url + "/generate", json={
                    "input_ids": prompt, "sampling_params": {"max_new_tokens": 12, "temperature": 0}}) as r:
                body = await r.json()
                if r.status != 200:
                    raise RuntimeError(body)
        except Exception as e:
            totals["failed"] += 1
            totals.setdefault("error", repr(e)[:300])
            history[c] = prompt
            return
        totals["requests"] += 1
        totals["prompt"] += body["meta_info"]["prompt_tokens"]
        totals["cached"] += body["meta_info"]["cached_tokens"]
        history[c] = prompt + body["output_ids"]

    async def conversation(session, c):
        async with sem:
            for t in range(turns):
                await turn(session, c, t)

    async def one(session, c, t):
        async with sem:
            await turn(session, c, t)

    async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=300)) as session:
        if not waves:
            await asyncio.gather(*(conversation(session, c) for c in range(convs)))
        for t in range(turns if waves else 0):
            order = rng.sample(range(convs), convs)
            await asyncio.gather(*(one(session, c, t) for c in order))
    totals["hit_rate"] = totals["cached"] / max(1, totals["prompt"])
    return totals


def flush(url: str) -> None:
    wait_until(lambda: requests.post(url + "/flush_cache", timeout=30).status_code == 200, 30, "flush")


AUDITED = {"RADIXSERVE_KV_INDEX_ROUTING": "0"}  # a gateway that follows Redis but routes on its approximate index


def run_phase(redis: Redis, addrs: list[str], n_gateways: int, index: str, workload: dict) -> tuple[dict, list]:
    """Fresh gateways, the workload, their stats. `index`: exact (following Redis), approx (the static worker
    list) or audited (approximate routing, the KV events followed to classify its misses)."""
    follows = index != "approx"
    gws = [gateway(redis_url=redis.url, env=AUDITED if index == "audited" else None) if follows
           else gateway(workers=addrs) for _ in range(n_gateways)]
    try:
        for _, url in gws:
            ready(url, len(addrs), follows)
        flush(gws[0][1])
        if follows:  # the flush's clear reaches every index before the run
            time.sleep(0.3)
        result = asyncio.run(chats([u for _, u in gws], **workload))
        stats = [info(u)["routing"] for _, u in gws]
        return result, stats
    finally:
        stop(*(p for p, _ in gws))


def missed(stats: list[dict]) -> tuple[int, int, int]:
    """Cache-routed requests checked; of them, routed on a prefix evicted before the pick (the index stale);
    and on one evicted after it (while the request queued on the worker: no index could know)."""
    def total(key):
        return sum(sum(s.get(key, {}).values()) for s in stats)
    return total("cache_checked"), total("cache_missed"), total("cache_evicted_after")


def main(argv=None) -> None:
    p = argparse.ArgumentParser(prog="python -m bench.kv_routing", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--workers", type=int, default=4)
    p.add_argument("--pool", type=int, default=4096, help="each worker's KV pool, tokens")
    p.add_argument("--convs", type=int, default=16)
    p.add_argument("--turns", type=int, default=5)
    p.add_argument("--evict-convs", type=int, default=96,
                   help="conversations of the eviction phase, turn by turn (their histories overflow the pools)")
    p.add_argument("--lag-convs", type=int, default=48, help="conversations of the lag phase (16 at a time)")
    args = p.parse_args(argv)
    if shutil.which("redis-server") is None:
        raise SystemExit("redis-server is not installed")
    redis = Redis()
    workers = []
    fig: dict = {}
    try:
        addrs = []
        for i in range(args.workers):
            w = spawn("services.worker", "--model-path", "tiny-random", "--redis-url", redis.url, "--worker-id", f"w{i}",
                      "--max-total-tokens", str(args.pool), "--log-level", "warning")
            workers.append(w)
        for w in workers:
            addrs.append(wait_line(w, "WORKER READY").split()[2])
        hit = dict(convs=args.convs, turns=args.turns, seed=1, concurrency=args.convs)

        for label, n, index in (("exact_1gw", 1, "exact"), ("exact_2gw", 2, "exact"), ("approx_1gw", 1, "approx"),
                                ("approx_2gw", 2, "approx")):
            res, stats = run_phase(redis, addrs, n, index, hit)
            fig[label] = round(res["hit_rate"], 4)
            fig[label + "_failed"] = res["failed"]
            if label == "exact_2gw":
                fig["exact_2gw_decisions"] = [s["decisions"] for s in stats]
            print(f"{label}: hit rate {res['hit_rate']:.4f} ({res['requests']} requests, {res['failed']} failed"
                  f"{', e.g. ' + res['error'] if res['failed'] else ''})", flush=True)
        fig["ratio_exact"] = round(fig["exact_2gw"] / fig["exact_1gw"], 4)
        fig["ratio_approx"] = round(fig["approx_2gw"] / fig["approx_1gw"], 4)

        # Lag: the hit-rate phases' chats (16 at a time), through 2 gateways, 3x as many: a p99 over some
        # hundreds of batches per gateway, not the maximum of ~80.
        lag = dict(convs=args.lag_convs, turns=args.turns, seed=4, concurrency=16)
        res, stats = run_phase(redis, addrs, 2, "exact", lag)
        lags = [s["exact_index"] for s in stats]
        fig["event_lag_p99_ms"] = round(1000 * max(e["event_lag_p99_s"] for e in lags), 2)
        fig["event_lag_p50_ms"] = round(1000 * max(e["event_lag_p50_s"] for e in lags), 2)
        fig["event_lag_samples"] = [e["event_lag_samples"] for e in lags]
        print(f"lag: p99 {fig['event_lag_p99_ms']} ms, p50 {fig['event_lag_p50_ms']} ms (worst gateway; "
              f"{fig['event_lag_samples']} batches; {res['requests']} requests, {res['failed']} failed)", flush=True)

        # Eviction: histories 3x the pools, revisited turn by turn after every other conversation's turn. The
        # approximate index (audited: it routes, the KV events only classify its picks) promises them still.
        evict = dict(convs=args.evict_convs, turns=4, seed=2, concurrency=16, user_tokens=(80, 120), waves=True)
        for label, index in (("exact", "exact"), ("approx", "audited")):
            res, stats = run_phase(redis, addrs, 1, index, evict)
            checked, stale, after = missed(stats)
            fig[f"evicted_prefix_rate_{label}"] = round(stale / max(1, checked), 4)
            fig[f"evicted_prefix_checked_{label}"] = checked
            fig[f"evicted_after_pick_{label}"] = after
            print(f"eviction, {label}: routed on a prefix evicted before the pick {stale / max(1, checked):.2%} of "
                  f"{checked} cache-routed requests ({after} evicted after the pick, while queued; hit rate "
                  f"{res['hit_rate']:.3f}, {res['failed']} failed)", flush=True)

        # Publishing cost, from the workers' own counters (over every phase so far).
        gw, url = gateway(redis_url=redis.url)
        try:
            ready(url, len(addrs), True)
            cost = []
            for w in info(url)["workers"]:
                i = w["info"] or {}
                kv, busy = i.get("kv_events") or {}, (i.get("passes") or {}).get("busy_s", 0.0)
                if busy:
                    cost.append((kv.get("listener_s", 0) + kv.get("cpu_s", 0)) / busy)
            fig["publish_share_of_step_time"] = round(max(cost), 5) if cost else None
            fig["load_average_1m"] = os.getloadavg()[0]  # this machine's other work: lag and cost are CPU-bound
            print(f"publishing: {max(cost):.3%} of the worker's step time (worst worker)", flush=True)
        finally:
            stop(gw)

        # A new gateway on the warm fleet: ready -> full picture.
        ref, ref_url = gateway(redis_url=redis.url)
        try:
            ready(ref_url, len(addrs), True)
            want = exact(ref_url)["blocks"]
            new = spawn("services.gateway", "--model-path", "tiny-random", "--port", str(port := free_port()),
                        "--redis-url", redis.url, "--log-level", "warning")
            wait_line(new, "gateway ready")
            t_ready = time.monotonic()
            new_url = f"http://127.0.0.1:{port}"
            wait_until(lambda: (e := exact(new_url)).get("synced_workers") == len(addrs) and e["blocks"] == want, 10,
                       "new gateway synced", interval=0.005)
            fig["new_gateway_full_picture_s"] = round(time.monotonic() - t_ready, 3)
            print(f"new gateway: full picture ({want} blocks) {fig['new_gateway_full_picture_s']:.3f} s after ready",
                  flush=True)
            stop(new)
        finally:
            stop(ref)

        # Redis killed under load, restarted empty.
        gws = [gateway(redis_url=redis.url) for _ in range(2)]
        try:
            for _, u in gws:
                ready(u, len(addrs), True)
            load = dict(convs=32, turns=8, seed=3, concurrency=32)
            out: dict = {}
            th = threading.Thread(target=lambda: out.update(asyncio.run(chats([u for _, u in gws], **load))))
            th.start()
            time.sleep(1.0)
            redis.stop()
            time.sleep(1.5)
            redis.start()
            t_back = time.monotonic()
            wait_until(lambda: all((e := exact(u)).get("connected") and e.get("synced_workers") == len(addrs)
                                   for _, u in gws), 30, "resync after the outage")
            fig["outage_resync_s"] = round(time.monotonic() - t_back, 3)
            th.join()
            fig["outage_failed_requests"] = out.get("failed")
            fig["outage_requests"] = out.get("requests")
            print(f"outage: resynced {fig['outage_resync_s']:.3f} s after Redis returned; "
                  f"{out.get('failed')} of {out.get('requests', 0) + out.get('failed', 0)} requests failed", flush=True)
        finally:
            stop(*(p for p, _ in gws))
    finally:
        stop(*workers)
        redis.stop()

    goals = {
        "hit-rate ratio (exact, 2 vs 1 gateway) >= 0.98": fig.get("ratio_exact", 0) >= 0.98,
        "routing on an evicted prefix <= 1%": fig.get("evicted_prefix_rate_exact", 1) <= 0.01,
        "event lag p99 <= 50 ms": fig.get("event_lag_p99_ms", 1e9) <= 50,
        "publishing <= 1% of step time": (fig.get("publish_share_of_step_time") or 1) <= 0.01,
        "new gateway full picture <= 1 s": fig.get("new_gateway_full_picture_s", 1e9) <= 1.0,
        "outage: no request failed, resync <= 2 s": fig.get("outage_failed_requests") == 0
        and fig.get("outage_resync_s", 1e9) <= 2.0,
    }
    for goal, ok in goals.items():
        print(f"{'PASS' if ok else 'FAIL'}  {goal}")
    print(json.dumps(fig))


if __name__ == "__main__":
    main()
