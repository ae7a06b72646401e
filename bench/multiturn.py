"""Multi-turn benchmark (issue 61): conversations whose histories together outgrow the GPU's KV pool, served
with the host KV tier off, then on, in one run.

    python -m bench.multiturn [--shape llama-3.1-8b|tiny] [--conversations 32 --turns 8 --user-len 384
        --answer-len 128] [--rate 4] [--think-time 0] [--max-total-tokens 30000] [--hicache-ratio R]
        [--out DIR] [-- extra services.launch flags for both stacks]

Each of N conversations starts at a Poisson arrival (--rate conversations a second) and runs T turns in
order: a turn sends the whole history plus a new user message of --user-len random tokens to /generate
(streamed, greedy, ignore_eos) and appends the model's answer of --answer-len tokens (its output ids) to the
history, then waits an exponential think time (mean --think-time s) before the next. Conversations
interleave, so by the last turns the live histories sum to N x T x (user + answer) tokens: the working set,
which must be at least 4x the GPU pool set small with --max-total-tokens (checked, a FAIL line otherwise).

The stack (services.launch, random weights of the shape) runs twice: host tier off, then on
(`--enable-hierarchical-cache --hicache-ratio R`, R by default large enough for the host to hold the working
set). Reported per run: TTFT p50/p99, output throughput, the prefix hit rate (cached / prompt tokens of the
responses) against the ideal (every token computed before reused: a turn could reuse its conversation's whole
previous prompt and answer but the answer's last token, whose KV was never computed), and from /get_server_info
the tiers' hit tokens, bytes loaded back and load time when the server reports them. Measured in the same run:
the pinned host-to-device copy rate, against which the load-back bandwidth is judged.

Goals (PASS/FAIL lines): TTFT p50 with the tier <= 0.5x without; output throughput >= 1.3x; hit rate >= 0.9 of
the ideal; load-back bandwidth >= 0.8 of the pinned copy rate. Results: --out/multiturn.json (never the tree).
"""
from __future__ import annotations

import argparse
import asyncio
import dataclasses
import json
import math
import os
import random
import time

import aiohttp

from bench.common import SHAPES, log, model_dir, pct, sse_events
from bench.serving import JSON_HEADERS, VOCAB
GOAL_TTFT_RATIO = 0.5
GOAL_TPUT_RATIO = 1.3
GOAL_HIT_OF_IDEAL = 0.9
GOAL_LOAD_BW = 0.8
GOAL_WORKING_SET = 4.0  # the workload's premise: live histories >= 4x the GPU pool
TIER_FLAG = "--enable-hierarchical-cache"


@dataclasses.dataclass(frozen=True)
class Workload:
    conversations: int
    turns: int
    user_len: int
    answer_len: int
    seed: int = 0

    def user_messages(self) -> list[list[list[int]]]:
        """[conversation][turn] -> the user message's token ids (fixed by the seed)."""
        rng = random.Random(self.seed)
        return [[[rng.randrange(10, VOCAB) for _ in range(self.user_len)] for _ in range(self.turns)]
                for _ in range(self.conversations)]

    def prompt_len(self, turn: int) -> int:
        """Prompt tokens of a conversation's turn (0-based): every earlier user message and answer, and its own."""
        return (turn + 1) * self.user_len + turn * self.answer_len

    def working_set(self) -> int:
        """Tokens of every conversation's history at its end (prompt and answer of the last turn)."""
        return self.conversations * (self.prompt_len(self.turns - 1) + self.answer_len)

    def ideal_hit_rate(self) -> float:
        """Every token computed before reused: turn t > 0 could find its previous turn's prompt and all of that
        turn's answer but the last token (sampled, never fed back, so no KV of it exists)."""
        hit = sum(self.prompt_len(t - 1) + self.answer_len - 1 for t in range(1, self.turns))
        return hit / sum(self.prompt_len(t) for t in range(self.turns))


def host_ratio_for(work: Workload, pool_tokens: int) -> float:
    """A host tier of this many GPU pools holds the whole working set, with a quarter to spare."""
    return float(math.ceil(1.25 * work.working_set() / pool_tokens))


# ------------------------------------------------------------------ the client
async def one_turn(session, url: str, ids: list[int], answer_len: int) -> dict:
    """One streamed /generate: TTFT, end-to-end time, the answer's ids and the tokens the server had cached."""
    body = json.dumps({"input_ids": ids, "stream": True, "sampling_params": {
        "max_new_tokens": answer_len, "ignore_eos": True, "temperature": 0}}).encode()
    t0 = time.perf_counter()
    ttft, last = None, None
    try:
        async with session.post(url + "/generate", data=body, headers=JSON_HEADERS) as resp:
            if resp.status != 200:
                return {"error": f"{resp.status}: {(await resp.text())[:200]}"}
            async for ev in sse_events(resp):
                if "error" in ev:
                    return {"error": str(ev["error"])[:200]}
                if ttft is None and ev.get("output_ids"):
                    ttft = time.perf_counter() - t0
                last = ev
    except aiohttp.ClientError as e:
        return {"error": repr(e)[:200]}
    if last is None or ttft is None:
        return {"error": "the stream ended without tokens"}
    meta = last.get("meta_info") or {}
    return {"ttft": ttft, "e2e": time.perf_counter() - t0, "output_ids": list(last["output_ids"]),
            "in": len(ids), "cached": int(meta.get("cached_tokens") or 0)}


async def run_conversations(url: str, work: Workload, rate: float, think_time: float, seed: int = 1) -> tuple[list, float]:
    """Every conversation, started at Poisson arrivals and run turn after turn; (per-turn results, wall seconds)."""
    rng = random.Random(seed)
    users = work.user_messages()
    starts, t = [], 0.0
    for _ in range(work.conversations):
        starts.append(t)
        t += rng.expovariate(rate) if rate != math.inf else 0.0
    thinks = [[rng.expovariate(1 / think_time) if think_time > 0 else 0.0 for _ in range(work.turns)]
              for _ in range(work.conversations)]
    results: list[dict] = []

    async def conversation(c: int, session) -> None:
        await asyncio.sleep(starts[c])
        history: list[int] = []
        for turn in range(work.turns):
            history = history + users[c][turn]
            r = await one_turn(session, url, history, work.answer_len)
            results.append({**r, "conversation": c, "turn": turn})
            if "error" in r:
                return  # the rest of this conversation would not be the workload
            history += r.pop("output_ids")
            if thinks[c][turn] and turn + 1 < work.turns:
                await asyncio.sleep(thinks[c][turn])

    conn = aiohttp.TCPConnector(limit=0)
    async with aiohttp.ClientSession(connector=conn, timeout=aiohttp.ClientTimeout(total=3600)) as session:
        t0 = time.perf_counter()
        await asyncio.gather(*(conversation(c, session) for c in range(work.conversations)))
        return results, time.perf_counter() - t0


def summarize(results: list[dict], wall: float, work: Workload) -> dict:
    ok = [r for r in results if "error" not in r]
    ttft = [r["ttft"] * 1e3 for r in ok]
    prompt, cached = sum(r["in"] for r in ok), sum(r["cached"] for r in ok)
    out_tokens = len(ok) * work.answer_len
    return {"turns": len(ok), "errors": len(results) - len(ok),
            "error_examples": [r["error"] for r in results if "error" in r][:3], "wall_s": wall,
            "out_tok_s": out_tokens / wall if wall else float("nan"), "prompt_tokens": prompt,
            "cached_tokens": cached, "hit_rate": cached / prompt if prompt else 0.0,
            "ttft_p50_ms": pct(ttft, 0.5), "ttft_p99_ms": pct(ttft, 0.99),
            "e2e_p50_ms": pct([r["e2e"] * 1e3 for r in ok], 0.5)}


# ------------------------------------------------------------------ the server's own figures
def cache_counters(url: str) -> dict[str, float]:
    """The workers' cache counters summed (engine info "cache"): the device tree's hit tokens, and where the host
    tier reports them its hit tokens, bytes each way and load time. Read defensively: a key the server does not
    report is absent."""
    import requests

    total: dict[str, float] = {}
    for w in requests.get(url + "/get_server_info", timeout=30).json().get("workers", []):
        for k, v in ((w.get("info") or {}).get("cache") or {}).items():
            if isinstance(v, (int, float)) and not isinstance(v, bool):
                total[k] = total.get(k, 0) + v
    return total


def tier_figures(before: dict, after: dict) -> dict:
    """What a run moved: counter deltas, and the load-back bandwidth where bytes and seconds are both reported."""
    d = {k: after[k] - before.get(k, 0) for k in after}
    out = {k: d[k] for k in ("hit_tokens", "host_hit_tokens", "bytes_h2d", "bytes_d2h", "load_seconds_sum",
                             "load_failures", "host_evicted_tokens", "evicted_tokens") if k in d}
    if d.get("bytes_h2d") and d.get("load_seconds_sum"):
        out["load_bw_Bps"] = d["bytes_h2d"] / d["load_seconds_sum"]
    return out


def measure_pinned_h2d(nbytes: int = 1 << 30, reps: int = 10) -> float:
    """Bytes a second of a pinned host tensor's .to('cuda', non_blocking=True) (median of reps); nan without CUDA."""
    import torch

    if not torch.cuda.is_available():
        return float("nan")
    src = torch.empty(nbytes, dtype=torch.uint8, pin_memory=True)
    dst = torch.empty(nbytes, dtype=torch.uint8, device="cuda")
    times = []
    for _ in range(reps + 2):
        s, e = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        s.record()
        dst.copy_(src, non_blocking=True)
        e.record()
        e.synchronize()
        times.append(s.elapsed_time(e) / 1e3)
    del src, dst
    torch.cuda.empty_cache()
    times = sorted(times[2:])
    return nbytes / times[len(times) // 2]


def tier_supported() -> bool:
    """This build's engine has the host KV tier's flag."""
    from shared.engine.config import EngineConfig

    return "enable_hierarchical_cache" in {f.name for f in dataclasses.fields(EngineConfig)}


def serve(path: str, port: int, extra: list[str], work: Workload, args) -> dict:
    """One stack with these flags: a warm-up conversation, the workload, its summary and the tier figures."""
    import requests

    from bench.stack import start_stack, stop_stack

    log(f"starting the stack {' '.join(extra)}")
    proc = start_stack(path, port, *extra)
    url = f"http://127.0.0.1:{port}"
    try:
        warm = Workload(2, 2, min(64, work.user_len), min(8, work.answer_len), seed=99)
        asyncio.run(run_conversations(url, warm, math.inf, 0.0))
        requests.post(url + "/flush_cache", timeout=30)
        before = cache_counters(url)
        results, wall = asyncio.run(run_conversations(url, work, args.rate, args.think_time))
        s = summarize(results, wall, work)
        s["tier"] = tier_figures(before, cache_counters(url))
        info = requests.get(url + "/get_server_info", timeout=30).json().get("workers", [{}])
        s["hicache"] = [(w.get("info") or {}).get("hicache") for w in info]
        log(f"  {s['turns']} turns, {s['out_tok_s']:.0f} out tok/s, TTFT p50 {s['ttft_p50_ms']:.1f} ms p99 "
            f"{s['ttft_p99_ms']:.1f} ms, hit rate {s['hit_rate']:.3f}, errors {s['errors']}; tier {s['tier']}")
        return s
    finally:
        stop_stack(proc)


def verdicts(res: dict, judged: bool) -> list[tuple[str, str]]:
    """(PASS | FAIL | INFO | SKIP, text) per goal."""
    def v(ok: bool) -> str:
        return ("PASS" if ok else "FAIL") if judged else "INFO"

    lines = []
    ws = res["working_set_of_pool"]
    lines.append((v(ws >= GOAL_WORKING_SET), f"working set {res['working_set_tokens']} tokens = {ws:.1f}x the GPU pool "
                                             f"(the workload's premise: >= {GOAL_WORKING_SET})"))
    off, on, ideal = res["runs"].get("off"), res["runs"].get("on"), res["ideal_hit_rate"]
    for name, s in res["runs"].items():
        if s["errors"] or not s["turns"]:
            lines.append(("FAIL", f"tier {name}: {s['errors']} failed turns {s['error_examples']}"))
    if on is None or off is None:
        lines.append(("SKIP", f"host tier: {res.get('on_skipped', 'not run')}" if on is None else
                              "tier on / off: the tier-off run was not asked for (--runs)"))
        return lines
    r = on["ttft_p50_ms"] / off["ttft_p50_ms"]
    lines.append((v(r <= GOAL_TTFT_RATIO), f"TTFT p50 tier on / off = {r:.2f} ({on['ttft_p50_ms']:.1f} vs "
                                           f"{off['ttft_p50_ms']:.1f} ms; p99 {on['ttft_p99_ms']:.1f} vs "
                                           f"{off['ttft_p99_ms']:.1f}; goal <= {GOAL_TTFT_RATIO})"))
    r = on["out_tok_s"] / off["out_tok_s"]
    lines.append((v(r >= GOAL_TPUT_RATIO), f"output throughput tier on / off = {r:.2f}x ({on['out_tok_s']:.0f} vs "
                                           f"{off['out_tok_s']:.0f} tok/s; goal >= {GOAL_TPUT_RATIO}x)"))
    hr = on["hit_rate"] / ideal
    lines.append((v(hr >= GOAL_HIT_OF_IDEAL), f"hit rate tier on {on['hit_rate']:.3f} = {hr:.3f} of the ideal "
                                              f"{ideal:.3f} (off: {off['hit_rate'] / ideal:.3f}; goal >= {GOAL_HIT_OF_IDEAL})"))
    bw, pinned = on["tier"].get("load_bw_Bps"), res["pinned_h2d_Bps"]
    if bw and pinned == pinned:  # pinned is nan without CUDA
        lines.append((v(bw / pinned >= GOAL_LOAD_BW), f"load-back {bw / 1e9:.1f} GB/s = {bw / pinned:.2f} of the "
                                                      f"pinned copy rate {pinned / 1e9:.1f} GB/s (goal >= {GOAL_LOAD_BW})"))
    else:
        lines.append(("SKIP" if judged else "INFO",
                      f"load-back bandwidth: the server reports bytes_h2d {on['tier'].get('bytes_h2d')} and "
                      f"load_seconds_sum {on['tier'].get('load_seconds_sum')}; pinned copy rate {pinned / 1e9:.1f} GB/s"))
    lines.append(("INFO", f"tier on: host hit tokens {on['tier'].get('host_hit_tokens')}, device hit tokens "
                          f"{on['tier'].get('hit_tokens')}, bytes to device {on['tier'].get('bytes_h2d')}, to host "
                          f"{on['tier'].get('bytes_d2h')}"))
    return lines


def main(argv=None):
    ap = argparse.ArgumentParser(prog="python -m bench.multiturn", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--shape", default="llama-3.1-8b", choices=sorted(SHAPES))
    ap.add_argument("--conversations", type=int, default=32)
    ap.add_argument("--turns", type=int, default=8)
    ap.add_argument("--user-len", type=int, default=384, help="tokens of each user message")
    ap.add_argument("--answer-len", type=int, default=128, help="tokens of each answer (ignore_eos)")
    ap.add_argument("--rate", type=float, default=4.0, help="conversations started a second, Poisson (inf: all at once)")
    ap.add_argument("--think-time", type=float, default=0.0, help="mean seconds between an answer and the next turn")
    ap.add_argument("--max-total-tokens", type=int, default=30000, help="the GPU KV pool, in tokens (both runs)")
    ap.add_argument("--hicache-ratio", type=float, default=None,
                    help="host tier size in GPU pools (default: the working set with a quarter to spare)")
    ap.add_argument("--runs", default="off,on", help="off, on or both, in that order")
    ap.add_argument("--port", type=int, default=31100)
    ap.add_argument("--out", default=os.environ.get("OUT", "/tmp/bench-out"))
    ap.add_argument("launch_args", nargs="*", help="after --: extra services.launch flags (both runs)")
    args = ap.parse_args(argv)
    if min(args.conversations, args.turns, args.user_len, args.answer_len, args.max_total_tokens) < 1:
        ap.error("--conversations, --turns, --user-len, --answer-len and --max-total-tokens must be >= 1")
    if args.rate <= 0 or args.think_time < 0:
        ap.error("--rate must be > 0 and --think-time >= 0")
    runs = [r for r in args.runs.split(",") if r]
    if not runs or any(r not in ("off", "on") for r in runs):
        ap.error("--runs: a comma list of off and on")
    os.makedirs(args.out, exist_ok=True)
    work = Workload(args.conversations, args.turns, args.user_len, args.answer_len)
    ratio = args.hicache_ratio or host_ratio_for(work, args.max_total_tokens)
    import torch

    cuda = torch.cuda.is_available()
    res: dict = {"date": time.strftime("%Y-%m-%d %H:%M"), "shape": args.shape, "args": vars(args),
                 "gpu": torch.cuda.get_device_name() if cuda else "cpu", "workload": dataclasses.asdict(work),
                 "working_set_tokens": work.working_set(),
                 "working_set_of_pool": work.working_set() / args.max_total_tokens,
                 "ideal_hit_rate": work.ideal_hit_rate(), "hicache_ratio": ratio, "runs": {}}
    log("pinned host-to-device copy rate")
    res["pinned_h2d_Bps"] = measure_pinned_h2d()
    log(f"  {res['pinned_h2d_Bps'] / 1e9:.1f} GB/s; working set {work.working_set()} tokens = "
        f"{res['working_set_of_pool']:.1f}x the pool of {args.max_total_tokens}; ideal hit rate {res['ideal_hit_rate']:.3f}")
    path = model_dir(args.shape)
    base = ["--max-total-tokens", str(args.max_total_tokens), *args.launch_args]
    for name in runs:
        if name == "on" and not tier_supported():
            res["on_skipped"] = f"this build has no {TIER_FLAG}"
            log(f"tier on: skipped ({res['on_skipped']})")
            continue
        extra = base + ([TIER_FLAG, "--hicache-ratio", str(ratio)] if name == "on" else [])
        log(f"tier {name}: {work.conversations} conversations x {work.turns} turns ({work.user_len} + "
            f"{work.answer_len} tokens a turn), rate {args.rate}/s")
        res["runs"][name] = serve(path, args.port, extra, work, args)
    lines = verdicts(res, judged=cuda)
    res["verdicts"] = lines
    with open(os.path.join(args.out, "multiturn.json"), "w") as f:
        json.dump(res, f, indent=2)
    print(f"\n{res['gpu']}: {work.conversations} x {work.turns} turns, GPU pool {args.max_total_tokens} tokens, "
          f"host tier {ratio:g}x")
    print(f"{'run':6s} {'turns':>6s} {'out tok/s':>10s} {'TTFT p50':>9s} {'p99':>9s} {'hit/ideal':>9s} {'err':>4s}")
    for name, s in res["runs"].items():
        print(f"{name:6s} {s['turns']:6d} {s['out_tok_s']:10.0f} {s['ttft_p50_ms']:9.1f} {s['ttft_p99_ms']:9.1f} "
              f"{s['hit_rate'] / res['ideal_hit_rate']:9.3f} {s['errors']:4d}")
    print()
    for verdict, text in lines:
        print(f"{verdict}  {text}")
    return res


if __name__ == "__main__":
    main()
