"""Generated-shared-prefix benchmark (issue 11): groups of requests sharing a long system prompt, each
with its own question, all arriving at once, interleaved across groups. Offline, through the real engine
(scheduler, radix cache, CUDA graphs), random weights of the Llama-3.1-8B shape like bench/offline.py.

    python -m bench.shared_prefix [--groups 64 --per-group 16 --system-len 2048 --question-len 128
                                   --output-len 256] [--smoke] [--out DIR]

Measures, on one engine's weights and KV pool:
  1. throughput and prefix hit rate with radix + LPM, radix + FCFS, radix off; the hit rate against the
     ideal computed from the workload (every group's system prompt computed once);
  2. decode step time at batch --decode-bs: groups of --decode-group requests sharing a
     --decode-prefix-token prefix, with and without shared-prefix (cascade) attention, and the same batch
     with no prefix.
Prints PASS/FAIL lines against the issue's goals. --smoke: the tiny shape on whatever device is there,
a few requests (seconds on the CPU); the throughput and step-time goals are then only informational.
"""
from __future__ import annotations

import argparse
import json
import os
import random
import time
from dataclasses import dataclass

import torch

from bench.common import drive, log, median, model_dir, start_engine
from shared.engine.config import EngineConfig
from shared.engine.engine_loop import Engine
from shared.tokenizer import Tokenizer

GREEDY_FIXED = {"temperature": 0, "ignore_eos": True}
VOCAB = 400  # token ids in [3, VOCAB): inside every shape's and the tiny tokenizer's vocabulary

GOAL_HIT_OF_IDEAL = 0.95
GOAL_RADIX_SPEEDUP = 4.0
GOAL_STEP_RATIO = 1.3


def workload(groups: int, per_group: int, system_len: int, question_len: int, seed: int) -> list[list[int]]:
    """Prompts in arrival order: round k holds the k-th question of every group (interleaved)."""
    rng = random.Random(seed)
    systems = [[rng.randrange(3, VOCAB) for _ in range(system_len)] for _ in range(groups)]
    return [systems[g] + [rng.randrange(3, VOCAB) for _ in range(question_len)]
            for _ in range(per_group) for g in range(groups)]


def ideal_hit_rate(groups: int, per_group: int, system_len: int, question_len: int) -> float:
    """Every system prompt computed once, every other prompt token computed."""
    return (per_group - 1) * system_len / (per_group * (system_len + question_len))


CONFIGS = {"lpm": {"schedule_policy": "lpm"},  # the engine's default LPM (queue limit as configured)
           "lpm0": {"schedule_policy": "lpm", "lpm_queue_limit": 0},  # LPM over any queue length
           "fcfs": {"schedule_policy": "fcfs"},
           "off": {"disable_radix_cache": True}}


def config_overrides(name: str, max_running: int) -> dict:
    """A --configs entry: NAME or NAME@N (N: requests decoded together, at most the engine's max_running)."""
    base, _, n = name.partition("@")
    if base not in CONFIGS:
        raise SystemExit(f"unknown config {name!r}: one of {', '.join(CONFIGS)}, optionally @N")
    running = int(n) if n else max_running
    if not 0 < running <= max_running:
        raise SystemExit(f"config {name!r}: @N must be in 1..{max_running} (the engine's running requests)")
    return {**CONFIGS[base], "max_running_requests": running}


def variant(base: Engine, tok: Tokenizer, **overrides) -> Engine:
    """A fresh engine (scheduler, cache) on the same weights and KV pool; the old one must be idle."""
    base.cache.reset()
    cfg = EngineConfig(**{**base.config.__dict__, **overrides})
    return Engine(cfg, tok, on_output=lambda o: None, runner=base.runner)


def shared_prefix_available(eng: Engine) -> bool:
    """The backend has shared-prefix attention and it survived the runner's warm-up (read before any
    toggling)."""
    backend = eng.runner.attn_backend
    return bool(getattr(backend, "supports_cascade", False) and backend.cascade_enabled)


def set_shared_prefix_attention(eng: Engine, on: bool) -> None:
    eng.runner.attn_backend.cascade_enabled = on


@dataclass
class StepTimes:
    synced_ms: float  # synced around each launch: the device's step plus the host's planning of it
    period_ms: float  # between consecutive launches with overlap on: what a running batch sees per token
    full_steps: int
    cascade_steps: int


def decode_step_ms(eng: Engine, prompts: list[list[int]], out_len: int, bs: int) -> StepTimes:
    """Median synced decode step time over the steps that ran the full batch, how many did, and how
    many decode steps used shared-prefix attention."""
    be = eng.runner.attn_backend
    select, cascade_steps, grouped = be.select_prefix_groups, [0], []

    def counted(groups):
        chosen = select(groups)
        cascade_steps[0] += bool(chosen)
        if chosen:
            grouped.append(sum(len(m) for _, m in chosen))
        return chosen

    be.select_prefix_groups = counted
    try:
        st = drive(eng, prompts, {**GREEDY_FIXED, "max_new_tokens": out_len}, time_steps=True)
    finally:
        del be.select_prefix_groups  # back to the class's method
    full = [t for t, b in zip(st.decode_step_s, st.decode_step_bs) if b == bs]
    if grouped:
        log(f"  requests in shared-prefix groups per step: max {max(grouped)}, median {median(grouped)}")
    eng.cache.reset()
    # The same batch as the engine runs it (overlap on, nothing synced): the period between launches.
    periods = drive(eng, prompts, {**GREEDY_FIXED, "max_new_tokens": out_len}).decode_periods(bs)
    eng.cache.reset()
    nan = float("nan")
    return StepTimes(median(full) * 1e3 if full else nan, median(periods) * 1e3 if periods else nan,
                     len(full), cascade_steps[0])


def verdict(ok: bool, judged: bool) -> str:
    return ("PASS" if ok else "FAIL") if judged else "INFO"


def main(argv=None):
    ap = argparse.ArgumentParser(prog="python -m bench.shared_prefix", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--shape", default=None, help="llama-3.1-8b (default) or tiny (default with --smoke)")
    ap.add_argument("--groups", type=int, default=64)
    ap.add_argument("--per-group", type=int, default=16)
    ap.add_argument("--system-len", type=int, default=2048)
    ap.add_argument("--question-len", type=int, default=128)
    ap.add_argument("--output-len", type=int, default=256)
    ap.add_argument("--configs", default="lpm,fcfs,off",
                    help="comma list of lpm, lpm0 (LPM at any queue length), fcfs, off, each optionally @N "
                         "(at most N requests decoded together; default: the engine's running requests)")
    ap.add_argument("--max-running", type=int, default=None,
                    help="requests decoded together at most (every config). Default: the engine's, derived from "
                         "its KV pool and GPU (shared/engine/sizing.py), as are the CUDA graphs and prefill chunk: "
                         "the benchmark measures the defaults")
    ap.add_argument("--decode-bs", type=int, default=256)
    ap.add_argument("--decode-group", type=int, default=16)
    ap.add_argument("--decode-prefix", type=int, default=2048)
    ap.add_argument("--decode-question", type=int, default=128)
    ap.add_argument("--decode-out", type=int, default=48)
    ap.add_argument("--smoke", action="store_true", help="tiny shape, a few requests (CPU, seconds)")
    ap.add_argument("--out", default=os.environ.get("OUT", "/tmp/bench-out"))
    args = ap.parse_args(argv)
    if args.smoke:
        args.shape = args.shape or "tiny"
        # Prompts of >= 64 tokens: shorter ones are not deduplicated within an admission round.
        args.groups, args.per_group, args.system_len, args.question_len, args.output_len = 2, 3, 80, 8, 4
        args.decode_bs, args.decode_group, args.decode_prefix, args.decode_question, args.decode_out = 4, 2, 80, 8, 4
    args.shape = args.shape or "llama-3.1-8b"
    os.makedirs(args.out, exist_ok=True)
    cuda = torch.cuda.is_available()
    judged = not args.smoke
    res: dict = {"date": time.strftime("%Y-%m-%d %H:%M"), "shape": args.shape, "args": vars(args),
                 "gpu": torch.cuda.get_device_name() if cuda else "cpu"}

    path = model_dir(args.shape)
    tok = Tokenizer.load(path)
    max_ctx = max(args.system_len + args.question_len + args.output_len,
                  args.decode_prefix + args.decode_question + args.decode_out) + 64
    ec = EngineConfig(model_path=path, load_format="dummy", max_context_len=max(8192, max_ctx),
                      max_running_requests=args.max_running, cuda_graph=cuda,
                      max_total_tokens=None if cuda else 65536)
    base = start_engine(ec, tok, res)
    max_running = base.config.max_running_requests
    if args.decode_bs > max_running:
        raise SystemExit(f"--decode-bs {args.decode_bs} is above the engine's {max_running} running requests")
    configs = {name: config_overrides(name, max_running) for name in args.configs.split(",") if name}
    has_cascade = shared_prefix_available(base)
    res["shared_prefix_attention"] = has_cascade
    if args.smoke:  # tiny prefixes: let the smoke run take the shared-prefix path too
        be = base.runner.attn_backend
        be.cascade_min_group, be.cascade_min_prefix, be.cascade_min_saved_tokens = 2, 16, 0
    drive(base, workload(2, 2, 32, 8, seed=99), {**GREEDY_FIXED, "max_new_tokens": 4})  # warm-up

    # 1. The shared-prefix workload under each scheduling configuration.
    g, p, sl, ql, ol = args.groups, args.per_group, args.system_len, args.question_len, args.output_len
    prompts = workload(g, p, sl, ql, seed=1)
    ideal = ideal_hit_rate(g, p, sl, ql)
    res["ideal_hit_rate"] = ideal
    runs = {}
    for name, overrides in configs.items():
        eng = variant(base, tok, **overrides)
        log(f"{len(prompts)} requests ({g} groups x {p}, {sl}+{ql} in, {ol} out), config {name}")
        st = drive(eng, prompts, {**GREEDY_FIXED, "max_new_tokens": ol})
        runs[name] = {"out_tok_s": st.output_tokens / st.wall_s, "wall_s": st.wall_s,
                      "hit_rate": st.cached_tokens / st.prompt_tokens, "steps": st.steps,
                      "retractions": eng.policy.stats.retractions}
        log(f"  {runs[name]['out_tok_s']:.0f} out tok/s, hit rate {runs[name]['hit_rate']:.3f} "
            f"(ideal {ideal:.3f}), {st.wall_s:.1f}s")
        eng.cache.reset()
    res["runs"] = runs

    # 2. Decode step time at batch decode_bs.
    bs, dg, dp, dq, do = args.decode_bs, args.decode_group, args.decode_prefix, args.decode_question, args.decode_out
    eng = variant(base, tok)
    shared = workload(max(1, bs // dg), dg, dp, dq, seed=2)[:bs]
    alone = workload(bs, 1, 0, dq, seed=3)
    steps = {}
    if has_cascade:
        set_shared_prefix_attention(eng, True)
        log(f"decode step, batch {bs}: {bs // dg} groups x {dg} sharing {dp} tokens, shared-prefix attention")
        steps["shared_cascade"] = decode_step_ms(eng, shared, do, bs)
        set_shared_prefix_attention(eng, False)
    log(f"decode step, batch {bs}: shared prefix, plain attention")
    steps["shared_plain"] = decode_step_ms(eng, shared, do, bs)
    log(f"decode step, batch {bs}: no prefix ({dq}-token prompts)")
    set_shared_prefix_attention(eng, has_cascade)
    steps["no_prefix"] = decode_step_ms(eng, alone, do, bs)
    res["decode_step_ms"] = {k: v.period_ms for k, v in steps.items()}
    res["decode_step_synced_ms"] = {k: v.synced_ms for k, v in steps.items()}
    res["decode_step_counts"] = {k: v.full_steps for k, v in steps.items()}
    res["decode_cascade_steps"] = {k: v.cascade_steps for k, v in steps.items()}
    for k, v in steps.items():
        log(f"  {k}: {v.period_ms:.2f} ms/step pipelined, {v.synced_ms:.2f} synced, over {v.full_steps} "
            f"full-batch steps ({v.cascade_steps} steps with shared-prefix attention)")

    with open(os.path.join(args.out, "shared_prefix.json"), "w") as f:
        json.dump(res, f, indent=2)

    # Every run beside the radix-off run of the same concurrency (when there is one).
    print()
    print(f"{'config':12s} {'out tok/s':>10s} {'wall s':>7s} {'hit/ideal':>9s} {'vs off':>7s}")
    for name, r in runs.items():
        at = name.partition("@")[2]
        off = runs.get(f"off@{at}" if at else "off")
        vs = f"{r['out_tok_s'] / off['out_tok_s']:7.2f}" if off and not name.startswith("off") else "      -"
        print(f"{name:12s} {r['out_tok_s']:10.0f} {r['wall_s']:7.1f} {r['hit_rate'] / ideal:9.3f} {vs}")

    # Goals.
    print()
    lines = []
    if "lpm" in runs:
        hr = runs["lpm"]["hit_rate"]
        lines.append((hr >= GOAL_HIT_OF_IDEAL * ideal, True,
                      f"hit rate radix+LPM {hr:.3f} = {hr / ideal:.3f} of ideal {ideal:.3f} (goal >= {GOAL_HIT_OF_IDEAL})"))
    if "fcfs" in runs:
        hr = runs["fcfs"]["hit_rate"]
        lines.append((hr >= GOAL_HIT_OF_IDEAL * ideal, True,
                      f"hit rate radix+FCFS {hr:.3f} = {hr / ideal:.3f} of ideal (goal >= {GOAL_HIT_OF_IDEAL})"))
    if "lpm" in runs and "off" in runs:
        sp = runs["lpm"]["out_tok_s"] / runs["off"]["out_tok_s"]
        lines.append((sp >= GOAL_RADIX_SPEEDUP, judged,
                      f"radix+LPM vs off {sp:.2f}x output tok/s ({runs['lpm']['out_tok_s']:.0f} vs "
                      f"{runs['off']['out_tok_s']:.0f}; goal >= {GOAL_RADIX_SPEEDUP}x)"))
    if "lpm" in runs and "fcfs" in runs:
        r = runs["lpm"]["out_tok_s"] / runs["fcfs"]["out_tok_s"]
        lines.append((r >= 0.98, judged, f"LPM vs FCFS {r:.3f}x output tok/s (LPM must not lose; >= 0.98)"))
    base_ms = res["decode_step_ms"]["no_prefix"]
    best = res["decode_step_ms"].get("shared_cascade", res["decode_step_ms"]["shared_plain"])
    ratio = best / base_ms
    how = ("shared-prefix attention" if has_cascade else
           "shared-prefix attention unavailable (backend lacks it or it failed its warm-up)")
    lines.append((ratio <= GOAL_STEP_RATIO, judged,
                  f"decode step b{bs} with {dp}-token prefix per {dg} / no prefix = {ratio:.2f} ({how}; "
                  f"{best:.2f} vs {base_ms:.2f} ms between launches; goal <= {GOAL_STEP_RATIO})"))
    sy = res["decode_step_synced_ms"]
    sy_best = sy.get("shared_cascade", sy["shared_plain"])
    lines.append((True, False, f"the same synced around each launch (device + host planning): {sy_best:.2f} vs "
                               f"{sy['no_prefix']:.2f} ms = {sy_best / sy['no_prefix']:.2f}"))
    if has_cascade:
        plain = res["decode_step_ms"]["shared_plain"]
        lines.append((True, False, f"decode step with the prefix, plain attention: {plain:.2f} ms "
                                   f"({plain / base_ms:.2f}x no prefix)"))
    for ok, j, text in lines:
        print(f"{verdict(ok, j)}  {text}")
    print("INFO  zero-reuse overhead (goal <= 0.3%) is measured by bench/offline.py")
    return res


if __name__ == "__main__":
    main()
