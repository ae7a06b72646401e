"""Run workloads against a running stack, in interpreter mode and/or through the program endpoint.

Per (workload, mode): programs/s, output tokens/s, latency p50/p90 of one program, the prefix hit rate the
workers report (cached / prompt tokens over the run, from /server_info), and the offline-optimal hit rate
of the same request trace (bench/workloads/trace.py; recorded in interpreter mode: the endpoint sends the
same requests, which tests/e2e/test_lang_parity.py checks).
"""
from __future__ import annotations

import time
from concurrent.futures import ThreadPoolExecutor

import requests

from bench.workloads.programs import WORKLOADS
from bench.workloads.trace import BenchEndpoint, optimal_hit_rate, tokenized_trace

MODES = ("interpreter", "endpoint")


def cache_stats(url: str) -> dict:
    info = requests.get(url + "/server_info", timeout=30).json()
    workers = [w["info"] for w in info["workers"] if w.get("info")]
    return {k: sum(w.get(k, 0) for w in workers) for k in ("prompt_tokens", "cached_tokens", "generated_tokens")}


def _pct(xs: list[float], q: float) -> float:
    xs = sorted(xs)
    return xs[min(len(xs) - 1, int(q * len(xs)))] if xs else float("nan")


def run_one(url: str, workload: str, mode: str, instances: list[dict], parallel: int, duration_s: float,
            rtt_s: float = 0.0, fork_hint: bool = True, record: bool = False, flush: bool = True) -> dict:
    w = WORKLOADS[workload]
    backend = BenchEndpoint(url, rtt_s=rtt_s, fork_hint=fork_hint, record=record)
    if flush:
        requests.post(url + "/flush_cache", json={}, timeout=30)
    before = cache_stats(url)
    latencies: list[float] = []
    errors: list[str] = []
    deadline = time.perf_counter() + duration_s

    def one(kwargs: dict) -> None:
        if time.perf_counter() > deadline:
            return
        t0 = time.perf_counter()
        try:
            w.program.run(backend=backend, remote=(mode == "endpoint"), temperature=0, **kwargs)
        except Exception as e:  # a failed program is counted, not fatal
            errors.append(f"{type(e).__name__}: {e}"[:200])
            return
        latencies.append(time.perf_counter() - t0)

    t0 = time.perf_counter()
    with ThreadPoolExecutor(max(1, parallel)) as pool:
        list(pool.map(one, instances))
    wall = time.perf_counter() - t0
    after = cache_stats(url)
    prompt = after["prompt_tokens"] - before["prompt_tokens"]
    cached = after["cached_tokens"] - before["cached_tokens"]
    generated = after["generated_tokens"] - before["generated_tokens"]
    res = {"workload": workload, "mode": mode, "programs": len(latencies), "errors": len(errors),
           "error_examples": errors[:3], "wall_s": round(wall, 3),
           "programs_per_s": round(len(latencies) / wall, 3) if wall else 0.0,
           "output_tokens_per_s": round(generated / wall, 1) if wall else 0.0,
           "latency_p50_s": round(_pct(latencies, 0.5), 4), "latency_p90_s": round(_pct(latencies, 0.9), 4),
           "prompt_tokens": prompt, "cached_tokens": cached,
           "hit_rate": round(cached / prompt, 4) if prompt else 0.0,
           "rtt_ms": rtt_s * 1000, "fork_hint": fork_hint}
    if record:
        res["trace"] = backend.trace
    return res


def run_workloads(url: str, workloads: list[str], modes: list[str], parallel: int, instances: int,
                  duration_s: float, scale: float, seed: int, rtt_s: float = 0.0, fork_hint: bool = True,
                  optimal: bool = True, log=print, deadline: float | None = None) -> list[dict]:
    """`deadline` (time.monotonic()): workloads not yet started by then are skipped."""
    tokenizer = None
    if optimal:
        from shared.tokenizer import Tokenizer
        tokenizer = Tokenizer.load(requests.get(url + "/get_model_info", timeout=30).json()["model_path"])
    results = []
    for name in workloads:
        if deadline is not None and time.monotonic() > deadline:
            log(f"{name}: skipped (time budget spent)")
            continue
        data = WORKLOADS[name].make(instances, scale, seed)
        trace = None
        for mode in modes:
            r = run_one(url, name, mode, data, parallel, duration_s, rtt_s, fork_hint,
                        record=optimal and mode == "interpreter")
            trace = r.pop("trace", None) or trace
            results.append(r)
            log(f"{name:20s} {mode:11s} {r['programs']:4d} programs {r['programs_per_s']:7.2f}/s  "
                f"p50 {r['latency_p50_s']:.3f}s  hit {r['hit_rate']:.2f}  errors {r['errors']}")
        if optimal:
            if trace is None:  # endpoint only: record the same programs once in interpreter mode, untimed
                trace = run_one(url, name, "interpreter", data, parallel, duration_s, record=True)["trace"]
            opt = optimal_hit_rate(tokenized_trace(trace, tokenizer))["optimal_hit_rate"]
            for r in results:
                if r["workload"] == name:
                    r["optimal_hit_rate"] = round(opt, 4)
                    r["hit_rate_vs_optimal"] = round(r["hit_rate"] / opt, 4) if opt else None
    return results


def print_table(results: list[dict]) -> None:
    print(f"{'workload':20s} {'mode':11s} {'prog':>5s} {'prog/s':>8s} {'tok/s':>8s} {'p50 s':>7s} {'p90 s':>7s} "
          f"{'hit':>5s} {'optimal':>7s} {'err':>4s}")
    for r in results:
        print(f"{r['workload']:20s} {r['mode']:11s} {r['programs']:5d} {r['programs_per_s']:8.2f} "
              f"{r['output_tokens_per_s']:8.1f} {r['latency_p50_s']:7.3f} {r['latency_p90_s']:7.3f} "
              f"{r['hit_rate']:5.2f} {r.get('optimal_hit_rate', float('nan')):7.2f} {r['errors']:4d}")
