"""CPU time the PD workers burn while idle after some transfers (per thread), through the real stack.

    python -m bench.pd_idle_cpu [--shape tiny] [--requests 16]

A worker that is idle should use ~0% CPU. Kept UCX endpoints carry a pending receive each; if an await on
one spins the event loop (ucxx without Python futures polls with asyncio.sleep(0)), the decode worker's
event-loop thread shows ~100% here, and its engine thread fights it for the GIL under load.
"""
from __future__ import annotations

import argparse
import concurrent.futures as cf
import os
import sys
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

import requests  # noqa: E402

from bench.common import model_dir  # noqa: E402
from bench.pd import _worker_pid  # noqa: E402
from bench.stack import start_stack, stop_stack  # noqa: E402
from shared.procfs import thread_run_seconds  # noqa: E402


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--shape", default="tiny")
    ap.add_argument("--requests", type=int, default=16)
    ap.add_argument("--port", type=int, default=31993)
    ap.add_argument("--seconds", type=float, default=3.0)
    ap.add_argument("extra", nargs="*")
    args = ap.parse_args()
    proc = start_stack(model_dir(args.shape), args.port, "--topology", "pd", "--prefill", "1", "--decode", "1",
                       *args.extra)
    url = f"http://127.0.0.1:{args.port}"
    try:
        body = lambda i: {"input_ids": [3 + (i * 7 + j) % 390 for j in range(64)],
                          "sampling_params": {"max_new_tokens": 4, "temperature": 0, "ignore_eos": True}}
        with cf.ThreadPoolExecutor(8) as ex:
            list(ex.map(lambda i: requests.post(url + "/generate", json=body(i), timeout=120).json(),
                        range(args.requests)))
        time.sleep(1.0)
        workers = [w for w in requests.get(url + "/server_info", timeout=10).json()["workers"] if w["info"]]
        pids = {role: _worker_pid(proc.pid, role) for role in ("prefill", "decode")}
        a = {r: thread_run_seconds(p) for r, p in pids.items()}
        time.sleep(args.seconds)
        b = {r: thread_run_seconds(p) for r, p in pids.items()}
        for role in pids:
            busy = sorted(((b[role][t] - a[role].get(t, 0.0)) / args.seconds for t in b[role]), reverse=True)
            print(f"{role}: idle CPU {sum(busy):.2f} cores; busiest threads {[round(x, 2) for x in busy[:3]]}")
        print("transfers:", {w["info"]["role"]: w["info"].get("kv_transfer") for w in workers})
    finally:
        stop_stack(proc)


if __name__ == "__main__":
    main()
