"""python -m bench.workloads --stack URL [--parallel N] [--modes interpreter,endpoint] [--workloads a,b]
                            [--instances N] [--duration S] [--scale X] [--rtt-ms MS] [--out DIR]
python -m bench.workloads --ablations [--shape llama-3.1-8b] [--out DIR]   (starts its own stacks)

Writes DIR/workloads.json (or DIR/ablations.json + ablations.png) and prints a table."""
from __future__ import annotations

import argparse
import json
import os
import sys

from bench.workloads.driver import MODES, print_table, run_workloads
from bench.workloads.programs import WORKLOADS


def parse_args(argv=None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(prog="python -m bench.workloads", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--stack", help="URL of a running stack (gateway)")
    ap.add_argument("--ablations", action="store_true", help="start stacks per ablation and compare them")
    ap.add_argument("--workloads", default=",".join(WORKLOADS), help=f"comma-separated, of: {', '.join(WORKLOADS)}")
    ap.add_argument("--modes", default=",".join(MODES))
    ap.add_argument("--parallel", type=int, default=16, help="programs in flight at once")
    ap.add_argument("--instances", type=int, default=64, help="programs per workload and mode")
    ap.add_argument("--duration", type=float, default=60.0, help="stop starting programs after this many s")
    ap.add_argument("--scale", type=float, default=1.0, help="multiplies prompt and output lengths")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--rtt-ms", type=float, default=0.0, help="emulated client round trip per HTTP call")
    ap.add_argument("--no-fork-hint", action="store_true", help="interpreter mode without the fork prefix hint")
    ap.add_argument("--no-optimal", action="store_true", help="skip the offline-optimal hit rate")
    ap.add_argument("--shape", default="llama-3.1-8b", help="--ablations: model shape (bench/common.py)")
    ap.add_argument("--port", type=int, default=31970, help="--ablations: port of the stacks it starts")
    ap.add_argument("--budget", type=float, default=0.0,
                    help="--ablations: seconds in all; what would not fit is skipped (results are written as they come)")
    ap.add_argument("--out", default=os.environ.get("OUT", "/tmp/bench-out"))
    args = ap.parse_args(argv)
    args.workloads = [w for w in args.workloads.split(",") if w]
    args.modes = [m for m in args.modes.split(",") if m]
    unknown = [w for w in args.workloads if w not in WORKLOADS] + [m for m in args.modes if m not in MODES]
    if unknown:
        ap.error(f"unknown workload(s) or mode(s): {unknown}")
    if not args.ablations and not args.stack:
        ap.error("give --stack URL (or --ablations)")
    return args


def main(argv=None) -> int:
    args = parse_args(argv)
    os.makedirs(args.out, exist_ok=True)
    if args.ablations:
        from bench.workloads.ablations import run_ablations
        run_ablations(args)
        return 0
    results = run_workloads(args.stack.rstrip("/"), args.workloads, args.modes, args.parallel, args.instances,
                            args.duration, args.scale, args.seed, rtt_s=args.rtt_ms / 1000,
                            fork_hint=not args.no_fork_hint, optimal=not args.no_optimal,
                            log=lambda m: print(m, file=sys.stderr, flush=True))
    with open(os.path.join(args.out, "workloads.json"), "w") as f:
        json.dump({"args": {k: v for k, v in vars(args).items()}, "results": results}, f, indent=1)
    print_table(results)
    return 1 if any(r["errors"] for r in results) else 0


if __name__ == "__main__":
    sys.exit(main())
