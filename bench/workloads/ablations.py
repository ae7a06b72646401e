"""`python -m bench.workloads --ablations`: the paper's ablations on one GPU, sized for one 10-minute call.

Stacks (random weights of --shape, dummy load): baseline (radix cache, LPM, jump-forward), radix cache
off, jump-forward off (JSON only), fork prefix hint off (the gateway's --disable-fork-hint for the program
endpoint, the client's own warm-up left out in interpreter mode), FCFS. A client-side variant runs on the
baseline stack: an emulated client round trip of 20 ms (both modes). Each ratio is from one run.

Writes OUT/ablations.json and OUT/ablations.png (matplotlib, the `bench` extra) beside the paper's ratios
(Fig. 5/8, Llama-7B on A10G, SGLang vs vLLM).
"""
from __future__ import annotations

import json
import os
import time

from bench.workloads.driver import print_table, run_workloads

# SGLang vs vLLM throughput ratios the paper reports (radix cache and the rest of the co-design on vs off).
PAPER_RATIOS = {"mmlu": 6.5, "hellaswag": 33.0, "react": 5.4, "tree_of_thought": 1.75, "json": 2.4,
                "chat_short": 1.8, "chat_long": 1.06}
MAIN = ["mmlu", "hellaswag", "react", "generative_agents", "tree_of_thought", "skeleton_of_thought", "judge",
        "json", "chat_short", "chat_long", "rag", "no_reuse"]
STACK_START_S = 90  # a stack of the 8B shape with dummy weights, generously
FORKING = ["tree_of_thought", "judge", "skeleton_of_thought"]
REUSE = ["mmlu", "hellaswag", "react", "tree_of_thought", "judge", "chat_short", "no_reuse"]


# (stack, its services.launch flags, [(variant, run_workloads arguments)]), in order of priority.
PLAN = [
    ("baseline", [], [
        ("baseline", dict(workloads=MAIN, modes=["interpreter", "endpoint"])),
        ("rtt 20ms", dict(workloads=["react", "judge", "chat_short", "tree_of_thought"],
                          modes=["interpreter", "endpoint"], rtt_s=0.020, optimal=False)),
    ]),
    ("radix off", ["--disable-radix-cache"], [
        ("radix off", dict(workloads=REUSE + ["json", "chat_long"], modes=["interpreter"], optimal=False))]),
    ("jump-forward off", ["--disable-jump-forward"], [
        ("jump-forward off", dict(workloads=["json"], modes=["interpreter", "endpoint"], optimal=False))]),
    # The fork prefix hint off in both modes: the endpoint's through the gateway flag, the interpreter's
    # (the SDK's own warm-up request) through the client.
    ("fork hint off", ["--disable-fork-hint"], [
        ("fork hint off", dict(workloads=FORKING, modes=["interpreter", "endpoint"], fork_hint=False,
                               optimal=False))]),
    ("fcfs", ["--schedule-policy", "fcfs"], [
        ("fcfs", dict(workloads=["mmlu", "hellaswag", "tree_of_thought", "judge"], modes=["interpreter"],
                      optimal=False))]),
]


def _log(msg: str) -> None:
    print(f"[{time.strftime('%H:%M:%S')}] {msg}", flush=True)


def _index(results: list[dict]) -> dict:
    return {(r["workload"], r["mode"]): r for r in results}


def _ratio(a: dict, b: dict, key: str, workload: str, mode: str):
    ra, rb = a.get((workload, mode)), b.get((workload, mode))
    if not ra or not rb or not rb[key]:
        return None
    return round(ra[key] / rb[key], 3)


def run_ablations(args) -> dict:
    from bench.common import model_dir
    from bench.stack import start_stack, stop_stack

    path = model_dir(args.shape)
    url = f"http://127.0.0.1:{args.port}"
    common = dict(parallel=args.parallel, instances=args.instances, duration_s=args.duration, scale=args.scale,
                  seed=args.seed, log=_log)
    runs: dict[str, list[dict]] = {}
    t_start = time.monotonic()
    deadline = t_start + args.budget if args.budget else None
    out: dict = {}
    for stack_name, flags, variants in PLAN:
        if deadline is not None and time.monotonic() + STACK_START_S > deadline:
            _log(f"budget spent: stack {stack_name} skipped")
            continue
        _log(f"stack: {stack_name} {' '.join(flags)}")
        proc = start_stack(path, args.port, *flags)
        try:
            # Untimed: the first batch shapes and the JSON grammar compile are paid here, not by a workload.
            run_workloads(url, ["no_reuse", "json", "mmlu"], ["interpreter", "endpoint"], parallel=2, instances=2,
                          duration_s=args.duration, scale=args.scale, seed=args.seed + 1, optimal=False,
                          log=lambda m: None)
            for name, kw in variants:
                if deadline is not None and time.monotonic() + args.duration > deadline:
                    _log(f"budget spent: variant {name} skipped")
                    continue
                _log(f"variant: {name}")
                runs[name] = run_workloads(url, **{**common, **kw}, deadline=deadline)
                out = _finish(args, runs)  # written after every variant: a run cut short still leaves results
        finally:
            stop_stack(proc)
    for name, results in runs.items():
        print(f"\n== {name}")
        print_table(results)
    print("\nratios:", json.dumps(out.get("ratios"), indent=1))
    print("summary:", out.get("summary"))
    plot(out, os.path.join(args.out, "ablations.png"))
    return out


def _finish(args, runs: dict) -> dict:
    base = _index(runs.get("baseline", []))
    ratios: dict[str, dict] = {"radix_on_vs_off": {}, "lpm_vs_fcfs": {}, "fork_hint_on_vs_off": {},
                               "fork_hint_on_vs_off_endpoint": {},
                               "endpoint_vs_interpreter_rtt0": {}, "endpoint_vs_interpreter_rtt20": {},
                               "jump_forward_on_vs_off": {}, "hit_rate_vs_optimal": {}}
    off, fcfs, hint, rtt, jf = (_index(runs.get(k, [])) for k in ("radix off", "fcfs", "fork hint off", "rtt 20ms",
                                                           "jump-forward off"))
    for w in MAIN:
        ratios["radix_on_vs_off"][w] = _ratio(base, off, "programs_per_s", w, "interpreter")
        ratios["lpm_vs_fcfs"][w] = _ratio(base, fcfs, "programs_per_s", w, "interpreter")
        for mode in ("interpreter", "endpoint"):
            key = "fork_hint_on_vs_off" + ("" if mode == "interpreter" else "_endpoint")
            ratios[key][w] = _ratio(base, hint, "programs_per_s", w, mode)
        for key, runs_of in (("endpoint_vs_interpreter_rtt0", base), ("endpoint_vs_interpreter_rtt20", rtt)):
            ep, it = runs_of.get((w, "endpoint")), runs_of.get((w, "interpreter"))
            if ep and it and it["programs_per_s"]:
                ratios[key][w] = round(ep["programs_per_s"] / it["programs_per_s"], 3)
        for mode in ("interpreter", "endpoint"):
            r = base.get((w, mode))
            if r and r.get("optimal_hit_rate"):
                ratios["hit_rate_vs_optimal"][f"{w}/{mode}"] = r["hit_rate_vs_optimal"]
        ratios["jump_forward_on_vs_off"][w] = _ratio(base, jf, "programs_per_s", w, "interpreter")
    ratios = {k: {w: v for w, v in d.items() if v is not None} for k, d in ratios.items()}
    hits = list(ratios["hit_rate_vs_optimal"].values())
    summary = {"mean_hit_rate_vs_optimal": round(sum(hits) / len(hits), 4) if hits else None,
               "zero_reuse_overhead": _ratio(off, base, "programs_per_s", "no_reuse", "interpreter")}
    out = {"date": time.strftime("%Y-%m-%d %H:%M"), "shape": args.shape, "instances": args.instances,
           "parallel": args.parallel, "scale": args.scale, "paper_ratios": PAPER_RATIOS, "ratios": ratios,
           "summary": summary, "runs": runs}
    with open(os.path.join(args.out, "ablations.json"), "w") as f:
        json.dump(out, f, indent=1)
    return out


def plot(out: dict, path: str) -> None:
    if not out.get("ratios"):
        return
    try:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        print("matplotlib is not installed (pip install '.[bench]'): no plot")
        return
    ratios = out["ratios"]
    fig, axes = plt.subplots(1, 3, figsize=(17, 4.5))
    ws = [w for w in MAIN if w in ratios["radix_on_vs_off"]]
    x = range(len(ws))
    ax = axes[0]
    ax.bar([i - 0.2 for i in x], [ratios["radix_on_vs_off"][w] for w in ws], 0.4, label="ours: radix on / off")
    ax.bar([i + 0.2 for i in x], [PAPER_RATIOS.get(w, 0) for w in ws], 0.4, label="paper: SGLang / vLLM")
    ax.set_xticks(list(x), ws, rotation=45, ha="right")
    ax.set_yscale("log")
    ax.set_title("throughput ratio (programs/s)")
    ax.legend()
    ax = axes[1]
    keys = ["lpm_vs_fcfs", "fork_hint_on_vs_off", "fork_hint_on_vs_off_endpoint", "endpoint_vs_interpreter_rtt0",
            "endpoint_vs_interpreter_rtt20", "jump_forward_on_vs_off"]
    ws2 = sorted({w for k in keys for w in ratios[k]})
    width = 0.8 / len(keys)
    for j, k in enumerate(keys):
        ax.bar([i + j * width for i in range(len(ws2))], [ratios[k].get(w, 0) for w in ws2], width, label=k)
    ax.axhline(1.0, color="black", lw=0.8)
    ax.set_xticks([i + 0.4 for i in range(len(ws2))], ws2, rotation=45, ha="right")
    ax.set_title("other ablations (ratio, >1 = first is faster)")
    ax.legend(fontsize=7)
    ax = axes[2]
    hv = ratios["hit_rate_vs_optimal"]
    ax.bar(range(len(hv)), list(hv.values()))
    ax.axhline(0.96, color="red", lw=0.8, label="paper: 96% of optimal on average")
    ax.set_xticks(range(len(hv)), list(hv), rotation=60, ha="right", fontsize=7)
    ax.set_title("hit rate / offline optimum")
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=100)
