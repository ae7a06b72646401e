"""Host time of jump-forward's catch-up passes, alone: bench/structured.py's JSON workload in jump-forward
mode only, instrumented (bench/pass_breakdown.py), several runs in one process; the catch-up row's phases
per run and their medians, and a digest of every output (ids and text), which must not change with host
optimizations.

    python -m bench.catchup_host [--shape tiny-wide] [--num-reqs 64] [--runs 5] [--cpu-time]

--cpu-time times the phases in the engine thread's CPU time instead of wall time: on a shared machine other
processes then cost nothing (waits for a GPU would read as zero: for CPU runs).
"""
from __future__ import annotations

import argparse
import hashlib
import json
import os
import statistics
import sys
import time
import types

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import torch  # noqa: E402

import bench.pass_breakdown as pass_breakdown  # noqa: E402
from bench.common import SHAPES, drive, model_dir  # noqa: E402
from bench.structured import SCHEMA  # noqa: E402
from shared.engine.config import EngineConfig  # noqa: E402
from shared.engine.engine import Engine  # noqa: E402
from shared.tokenizer import Tokenizer  # noqa: E402

PHASES = ("schedule", "cache", "kv-run", "process", "jumps", "masks")


def outputs_digest(outputs: dict) -> str:
    """The outputs by request index (rids carry a per-run prefix), hashed."""
    by_index = sorted((rid.rsplit("-", 1)[1], o.token_ids, o.text) for rid, o in outputs.items())
    return hashlib.sha1(json.dumps(by_index).encode()).hexdigest()[:12]


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--shape", default="tiny-wide", choices=sorted(SHAPES))
    ap.add_argument("--num-reqs", type=int, default=64)
    ap.add_argument("--runs", type=int, default=5)
    ap.add_argument("--cpu-time", action="store_true", help="phases in the engine thread's CPU time")
    args = ap.parse_args()
    if args.cpu_time:
        pass_breakdown.time = types.SimpleNamespace(perf_counter=time.thread_time)
    path = model_dir(args.shape)
    tok = Tokenizer.load(path)
    eng = Engine(EngineConfig(model_path=path, load_format="dummy", max_context_len=4096, max_running_requests=256,
                              cuda_graph=torch.cuda.is_available()), tok, on_output=lambda o: None)
    prompts = [tok.encode(f"Record {i}: extract the customer fields as JSON.\n") for i in range(args.num_reqs)]
    sampling = {"json_schema": json.dumps(SCHEMA), "temperature": 0, "max_new_tokens": 512}
    drive(eng, prompts[:4], sampling)  # warm-up (and the grammar compiled)
    rows = []
    for run in range(args.runs):
        eng.cache.reset()
        bd = pass_breakdown.PassBreakdown(eng)
        try:
            st = drive(eng, prompts, sampling)
        finally:
            bd.close()
        row = bd.summary()["catch-up"]
        rows.append(row)
        ph = row["phases_ms"]
        print(f"run {run}: {row['passes']} catch-up passes, {row['rows']:.1f} rows, {row['tokens']:.0f} tokens; ms "
              + " ".join(f"{p} {ph[p]:.2f}" for p in PHASES) + f"; outputs {outputs_digest(st.outputs)}", flush=True)
    print("median ms per catch-up pass: " + " ".join(
        f"{p} {statistics.median(r['phases_ms'][p] for r in rows):.2f}" for p in PHASES))
    eng.stop()


if __name__ == "__main__":
    main()
