"""Prefill/decode disaggregation vs unified workers on the same GPUs, through the real stack.

    python -m bench.pd [--shape llama-3.1-8b|tiny] [--rate 6] [--duration 45] [--gpus 0,1]

Both configurations get the same GPUs: `unified` runs one unified worker per GPU, `pd` one prefill and
one decode worker (KV pages over UCX between them). The workload is open-loop: Poisson arrivals of
distinct long prompts (no cache reuse), streamed outputs of fixed length. Reported per configuration:
TTFT and inter-token latency (p50 / p99), output throughput, and for PD what the KV transfer cost
(bytes, seconds, GB/s as seen by the decode side). Greedy outputs of a few prompts are compared across
the two configurations (same dummy weights). Prints a short table last; writes pd.json to --out.

Guard (prints PASS/FAIL lines; exit status 1 on a FAIL with --check): PD's ITL p99 at most half the
unified stack's (what PD is for: decode never waits behind a prefill), and the PD decode worker's ITL
p50 within 5% of the unified workers' (a decode worker that runs no prefill must not step slower; an event
loop spinning on UCX polls once made it 30-70% slower).

--profile: while PD runs under load, py-spy dumps of every decode-worker thread (GIL holder marked), a
py-spy GIL-only record, and per-thread CPU of the decode worker, written to --out.
"""
from __future__ import annotations

import argparse
import asyncio
import json
import os
import random
import sys
import time

import aiohttp
import requests

from bench.common import SHAPES, log, model_dir, pct, sse_events
from bench.profile import profile_process
from bench.stack import start_stack, stop_stack
from shared import procfs


async def one_request(session: aiohttp.ClientSession, url: str, ids: list[int], out_len: int) -> dict:
    body = {"input_ids": ids, "stream": True,
            "sampling_params": {"max_new_tokens": out_len, "ignore_eos": True, "temperature": 0}}
    t0 = time.perf_counter()
    ttft, gaps, last_t, last_n, n = None, [], None, 0, 0
    async with session.post(url + "/generate", json=body) as resp:
        if resp.status != 200:
            return {"error": f"{resp.status}: {await resp.text()}"}
        async for ev in sse_events(resp):
            if "error" in ev:
                return {"error": str(ev["error"])}
            n = ev["meta_info"]["completion_tokens"]
            now = time.perf_counter()
            if n and ttft is None:
                ttft = now - t0
            elif n > last_n and last_t is not None:
                gaps.extend([(now - last_t) / (n - last_n)] * (n - last_n))
            if n > last_n:
                last_t, last_n = now, n
    return {"ttft": ttft, "gaps": gaps, "tokens": n, "e2e": time.perf_counter() - t0}


async def workload(url: str, prompts: list[list[int]], rate: float, out_len: int, seed: int) -> dict:
    rng = random.Random(seed)
    timeout = aiohttp.ClientTimeout(total=600)
    async with aiohttp.ClientSession(timeout=timeout, connector=aiohttp.TCPConnector(limit=0)) as session:
        tasks = []
        t0 = time.perf_counter()
        for ids in prompts:
            tasks.append(asyncio.create_task(one_request(session, url, ids, out_len)))
            await asyncio.sleep(rng.expovariate(rate))
        results = await asyncio.gather(*tasks)
        wall = time.perf_counter() - t0
    ok = [r for r in results if "error" not in r]
    errors = [r["error"] for r in results if "error" in r]
    gaps = [g for r in ok for g in r["gaps"]]
    ttfts = [r["ttft"] for r in ok if r["ttft"] is not None]
    return {"requests": len(results), "errors": len(errors), "first_error": errors[0] if errors else None,
            "wall_s": wall, "output_tok_per_s": sum(r["tokens"] for r in ok) / wall,
            "ttft_p50_ms": pct(ttfts, 0.5) * 1e3, "ttft_p99_ms": pct(ttfts, 0.99) * 1e3,
            "itl_p50_ms": pct(gaps, 0.5) * 1e3, "itl_p99_ms": pct(gaps, 0.99) * 1e3,
            "itl_max_ms": max(gaps, default=float("nan")) * 1e3}


def greedy_outputs(url: str, prompts: list[list[int]]) -> list[list[int]]:
    return [requests.post(url + "/generate", json={"input_ids": p, "sampling_params": {
        "max_new_tokens": 16, "temperature": 0, "ignore_eos": True}}, timeout=120).json().get("output_ids")
        for p in prompts]


def worker_stats(url: str) -> list[dict]:
    return [w["info"] for w in requests.get(url + "/server_info", timeout=10).json()["workers"] if w["info"]]


ITL_P99_RATIO = 0.5  # PD ITL p99 <= this x unified's
ITL_P50_SLACK = 1.05  # PD decode worker ITL p50 <= this x unified's


HANDOVER_PARTS = [
    ("queue", "queue (prefill worker)"), ("handshake", "handshake (header -> accept)"),
    ("prefill", "prefill (admitted -> token)"), ("wire", "wire (pages' send)"),
    ("first_token_to_ack", "token -> decode side's ack"), ("reserve", "decode slot reservation"),
    ("inbox", "pages -> decode engine"), ("scatter", "scatter (host side)"),
    ("first_step", "first decode step"),
]


def guard(res: dict) -> list[tuple[str, bool, str]]:
    u, p = res.get("unified"), res.get("pd")
    if not u or not p:
        return []
    return [
        ("PD ITL p99 <= 0.5x unified", p["itl_p99_ms"] <= ITL_P99_RATIO * u["itl_p99_ms"],
         f"{p['itl_p99_ms']:.2f} ms vs {u['itl_p99_ms']:.2f} ms (bound {ITL_P99_RATIO * u['itl_p99_ms']:.2f})"),
        ("PD decode ITL p50 within 5% of unified", p["itl_p50_ms"] <= ITL_P50_SLACK * u["itl_p50_ms"],
         f"{p['itl_p50_ms']:.2f} ms vs {u['itl_p50_ms']:.2f} ms (bound {ITL_P50_SLACK * u['itl_p50_ms']:.2f})"),
        ("PD TTFT p50 <= 1.10x unified (issue 10 goal)", p["ttft_p50_ms"] <= 1.10 * u["ttft_p50_ms"],
         f"{p['ttft_p50_ms']:.1f} ms vs {u['ttft_p50_ms']:.1f} ms"),
        ("PD TTFT p99 <= 1.25x unified (issue 10 goal)", p["ttft_p99_ms"] <= 1.25 * u["ttft_p99_ms"],
         f"{p['ttft_p99_ms']:.1f} ms vs {u['ttft_p99_ms']:.1f} ms"),
    ]


def _worker_pid(stack_pid: int, role: str = "decode") -> int | None:
    """The `role` worker among the stack's child processes (never another stack's on this host)."""
    return next((p for p in procfs.children(stack_pid) if procfs.flag_value(p, "--role") == role), None)


def profile_decode_worker(stack_pid: int, out_dir: str, delay: float = 8.0, seconds: float = 6.0):
    """py-spy (GIL holder only) and thread CPU of the decode worker, `delay` s into the load."""
    pid = _worker_pid(stack_pid)
    if pid is None:
        log("profile: no decode worker found")
        return None
    return profile_process(pid, os.path.join(out_dir, "decode_profile"), delay, seconds, gil=True)


def main():
    ap = argparse.ArgumentParser(prog="python -m bench.pd", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--shape", default="llama-3.1-8b", choices=sorted(SHAPES))
    ap.add_argument("--rate", type=float, default=6.0, help="arrivals per second (Poisson)")
    ap.add_argument("--duration", type=float, default=45.0, help="seconds of arrivals per configuration")
    ap.add_argument("--min-prompt", type=int, default=1024)
    ap.add_argument("--max-prompt", type=int, default=4096)
    ap.add_argument("--output-len", type=int, default=128)
    ap.add_argument("--gpus", default="0,1", help="GPU ids both configurations share ('' on the CPU)")
    ap.add_argument("--configs", default="unified,pd")
    ap.add_argument("--port", type=int, default=31991)
    ap.add_argument("--out", default=os.environ.get("OUT", "/tmp/bench-out"))
    ap.add_argument("--profile", action="store_true", help="py-spy + thread CPU of the PD decode worker")
    ap.add_argument("--check", action="store_true", help="exit 1 when a guard line FAILs")
    ap.add_argument("extra", nargs="*", help="engine flags for every worker (after --)")
    args = ap.parse_args()
    os.makedirs(args.out, exist_ok=True)
    path = model_dir(args.shape)
    vocab = 400  # within the tiny tokenizer (415 ids) that every bench model shape uses
    rng = random.Random(0)
    n = max(1, int(args.rate * args.duration))
    prompts = [[rng.randrange(3, vocab) for _ in range(rng.randint(args.min_prompt, args.max_prompt))]
               for _ in range(n)]
    warm = [[rng.randrange(3, vocab) for _ in range(args.min_prompt)] for _ in range(8)]
    check = [[rng.randrange(3, vocab) for _ in range(300 + 100 * i)] for i in range(4)]
    ngpu = len([g for g in args.gpus.split(",") if g.strip()])
    res: dict = {"date": time.strftime("%Y-%m-%d %H:%M"), "shape": args.shape, "rate": args.rate,
                 "requests": n, "prompt_len": [args.min_prompt, args.max_prompt], "output_len": args.output_len,
                 "gpus": args.gpus}
    url = f"http://127.0.0.1:{args.port}"
    outputs = {}
    for config in args.configs.split(","):
        topo = (["--topology", "pd", "--prefill", "1", "--decode", "1"] if config == "pd"
                else ["--workers", str(max(1, ngpu))])
        gpu_flags = ["--worker-gpus", args.gpus] if ngpu else []
        log(f"starting {config}: {' '.join(topo + gpu_flags + args.extra)}")
        proc = start_stack(path, args.port, *topo, *gpu_flags, *args.extra)
        try:
            outputs[config] = greedy_outputs(url, check)
            asyncio.run(workload(url, warm, rate=50.0, out_len=8, seed=1))
            before = worker_stats(url)
            prof = profile_decode_worker(proc.pid, args.out) if args.profile and config == "pd" else None
            r = asyncio.run(workload(url, prompts, args.rate, args.output_len, seed=2))
            after = worker_stats(url)
            if prof is not None:
                prof.join(60)
            kv_before = next((w.get("kv_transfer", {}) for w in before if w.get("role") == "prefill"), {})
            kv_after = next((w.get("kv_transfer", {}) for w in after if w.get("role") == "prefill"), {})
            dec_after = next((w.get("kv_transfer", {}) for w in after if w.get("role") == "decode"), {})
            if kv_after:
                b = kv_after["sent_bytes"] - kv_before.get("sent_bytes", 0)
                s = kv_after["send_seconds"] - kv_before.get("send_seconds", 0.0)
                k = kv_after["transfers"] - kv_before.get("transfers", 0)
                r["kv_transfer"] = {"bytes": b, "transfers": k, "send_seconds_summed": s,
                                    "ms_per_transfer": s / k * 1e3 if k else None,
                                    "gb_per_s": b / s / 1e9 if s else None,
                                    "tokens": kv_after["sent_tokens"] - kv_before.get("sent_tokens", 0),
                                    "late_handshakes": kv_after.get("late_handshakes", 0)
                                    - kv_before.get("late_handshakes", 0),
                                    "decode_failures": dec_after.get("failures")}
                # Hand-over parts per request (p50/p99 ms over each worker's recent requests, the few
                # warm-up ones included): prefill side then decode side, in the order a request meets them.
                r["handover_ms"] = {**kv_after.get("handover_ms", {}),
                                    **{k: v for k, v in dec_after.get("handover_ms", {}).items() if k != "requests"}}
            res[config] = r
            log(f"{config}: {json.dumps(r)}")
        except Exception:
            print("".join(getattr(proc, "log_tail", [])[-40:]), flush=True)
            raise
        finally:
            stop_stack(proc)
    if len(outputs) == 2:
        a, b = outputs.values()
        res["greedy_outputs_equal"] = a == b
    with open(os.path.join(args.out, "pd.json"), "w") as f:
        json.dump(res, f, indent=2)
    print(f"\n{n} requests, Poisson {args.rate}/s, prompts {args.min_prompt}-{args.max_prompt}, "
          f"output {args.output_len}, {args.shape}, GPUs {args.gpus or 'none'}")
    print(f"{'config':10s} {'tok/s':>8s} {'TTFT p50':>9s} {'TTFT p99':>9s} {'ITL p50':>8s} {'ITL p99':>8s} "
          f"{'ITL max':>8s} {'errors':>6s}")
    for config in args.configs.split(","):
        r = res.get(config)
        if r:
            print(f"{config:10s} {r['output_tok_per_s']:8.0f} {r['ttft_p50_ms']:9.1f} {r['ttft_p99_ms']:9.1f} "
                  f"{r['itl_p50_ms']:8.2f} {r['itl_p99_ms']:8.2f} {r['itl_max_ms']:8.1f} {r['errors']:6d}")
    if "pd" in res and "kv_transfer" in res["pd"]:
        kv = res["pd"]["kv_transfer"]
        print(f"KV transfer: {kv['transfers']} transfers, {kv['tokens']} tokens, {kv['bytes'] / 1e9:.2f} GB; "
              f"wire {kv['ms_per_transfer'] or 0:.2f} ms per transfer, {kv['gb_per_s'] or 0:.1f} GB/s; "
              f"prompts done before the handshake {kv['late_handshakes']}; "
              f"decode-side failures {kv['decode_failures']}")
    if "greedy_outputs_equal" in res:
        print(f"greedy outputs equal across configurations: {res['greedy_outputs_equal']}")
    if "pd" in res and res["pd"].get("handover_ms"):
        h = res["pd"]["handover_ms"]
        print("hand-over per request (ms)      p50      p99")
        for part, what in HANDOVER_PARTS:
            if part in h:
                print(f"  {what:28s} {h[part]['p50']:7.2f}  {h[part]['p99']:7.2f}")
    lines = guard(res)
    for name, ok, detail in lines:
        print(f"{'PASS' if ok else 'FAIL'}: {name}: {detail}")
    res["guard"] = [{"check": n, "pass": ok, "detail": d} for n, ok, d in lines]
    with open(os.path.join(args.out, "pd.json"), "w") as f:
        json.dump(res, f, indent=2)
    if args.check and not all(ok for name, ok, _ in lines if "goal" not in name):
        sys.exit(1)


if __name__ == "__main__":
    main()
