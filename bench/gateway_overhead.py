"""What the serving path costs per token without a model: the real gateway and the real worker server in
front of an engine that only emits tokens, so the CPU of the gateway and of the worker's IO per output
token is measured on any machine (no GPU), and a change to the wire, the dispatcher or the SSE path shows
as a number in seconds.

    python -m bench.gateway_overhead [--streams 256] [--tokens 128] [--step-ms 30] [--route completions]
                                     [--stream-interval 1] [--concurrency 0]

The fake engine runs the worker's real `WorkerServer`; every `--step-ms` it emits one token for each
running request in one `on_output` call, as the real engine does once per step. The gateway is
`python -m services.gateway` against it. Reported: output tokens/s, the gateway's and the worker
process's CPU µs per output token and per request (/proc schedstat, to the ns: the measured window holds
only ~0.2 s of gateway CPU), the client's CPU share, TTFT/ITL. On the H200 the engine steps at ~37 ms for
256 streams; `--step-ms 0` emits as fast as the gateway takes them (its ceiling).
"""
from __future__ import annotations

import argparse
import asyncio
import itertools
import os
import random
import subprocess
import sys
import threading
import time
from concurrent.futures import Future

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

from shared import procfs  # noqa: E402


class FakeEngine:
    """The engine interface WorkerServer uses, backed by a thread that emits a token per request per step."""

    def __init__(self, step_s: float, stream_interval: int = 1):
        self.step_s = step_s
        self.stream_interval = stream_interval  # as the engine's --stream-interval
        self.on_output = None
        self.steps = 0
        self._lock = threading.Lock()
        self._running: dict[str, list] = {}  # rid -> [emitted, max_new_tokens, prompt_len]
        self._wake = threading.Event()
        self.scheduler = self  # WorkerServer asks engine.scheduler.num_running()
        threading.Thread(target=self._loop, daemon=True, name="engine").start()

    def num_running(self) -> int:
        return len(self._running)

    def submit(self, msg) -> None:
        with self._lock:
            self._running[msg.rid] = [0, msg.sampling.max_new_tokens, len(msg.input_ids), []]
        self._wake.set()

    def abort(self, rid: str) -> None:
        with self._lock:
            self._running.pop(rid, None)

    def call(self, fn) -> Future:
        f: Future = Future()
        f.set_result(fn())
        return f

    def is_idle(self) -> bool:
        return not self._running

    def flush_cache(self):
        return True, "cache flushed"

    def info(self) -> dict:
        return {"model_path": "fake", "max_context_len": 1 << 20, "max_total_tokens": 1 << 24, "page_size": 1,
                "num_running": len(self._running), "num_waiting": 0, "kv_usage": 0.0, "vocab_size": 400}

    def _loop(self) -> None:
        from shared.protocol import FinishLength, TokenOutput

        tokens = itertools.cycle(range(10, 400))
        while True:
            if not self._running:
                self._wake.wait()
                self._wake.clear()
                continue
            t0 = time.perf_counter()
            outs = []
            with self._lock:
                for rid, st in list(self._running.items()):
                    st[0] += 1
                    st[3].append(next(tokens))
                    done = st[0] >= st[1]
                    if not done and st[0] > 1 and len(st[3]) < self.stream_interval:
                        continue
                    outs.append(TokenOutput(rid=rid, token_ids=st[3], text=" x" * len(st[3]), finished=done,
                                            finish_reason=FinishLength(length=st[1]) if done else None,
                                            prompt_tokens=st[2], completion_tokens=st[0]))
                    st[3] = []
                    if done:
                        del self._running[rid]
            self.steps += 1
            self.on_output(outs)
            left = self.step_s - (time.perf_counter() - t0)
            if left > 0:
                time.sleep(left)


async def _serve_fake_worker(port: int, step_s: float, stream_interval: int = 1) -> None:
    from services.worker.server import WorkerServer
    from shared.wire import internal_key

    server = WorkerServer(FakeEngine(step_s, stream_interval), internal_key=internal_key())
    bound = await server.start("127.0.0.1", port)
    print(f"FAKE WORKER {bound}", flush=True)
    await asyncio.Event().wait()


def _free_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _wait_line(proc: subprocess.Popen, prefix: str, timeout: float = 120.0) -> str:
    deadline = time.monotonic() + timeout
    for line in proc.stdout:
        if line.startswith(prefix) or prefix in line:
            threading.Thread(target=lambda: [None for _ in proc.stdout], daemon=True).start()
            return line
        if time.monotonic() > deadline:
            break
    raise RuntimeError(f"{prefix!r} never printed (exit {proc.poll()})")


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--streams", type=int, default=256, help="requests, all sent at once unless --concurrency")
    ap.add_argument("--concurrency", type=int, default=0,
                    help="at most this many in flight (0: all at once); e.g. --streams 3000 --tokens 2 "
                         "--concurrency 256 measures the per-request cost at a steady load")
    ap.add_argument("--tokens", type=int, default=128, help="output tokens per stream")
    ap.add_argument("--prompt-len", type=int, default=512, help="prompt tokens per request (random ids)")
    ap.add_argument("--step-ms", type=float, default=30.0)
    ap.add_argument("--route", default="completions", choices=["completions", "generate", "chat"])
    ap.add_argument("--no-stream", action="store_true")
    ap.add_argument("--stream-interval", type=int, default=1,
                    help="tokens per streamed increment, as the engine's --stream-interval")
    ap.add_argument("--gateway-processes", type=int, default=1,
                    help="gateway processes on the port (their CPU is summed); with --step-ms 0 this measures "
                         "whether the pool lifts the gateway's ceiling")
    ap.add_argument("--rounds", type=int, default=1,
                    help="run the load this many times against the same gateway, each reported (a cost that "
                         "grows from round to round is state the gateway keeps)")
    ap.add_argument("--profile", default=None, metavar="PREFIX", help="py-spy of the gateway under load (PREFIX.txt)")
    ap.add_argument("--fake-worker", type=int, default=None, help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.fake_worker is not None:
        from shared import event_loop

        event_loop.run(_serve_fake_worker(args.fake_worker, args.step_ms / 1000, args.stream_interval))
        return

    from bench.serving import MODEL, run_load, summarize

    # ROOT first, whatever else the caller's path holds kept (the GPU image's wheels live in a --target dir).
    env = {**os.environ, "RADIXSERVE_INTERNAL_KEY": os.environ.get("RADIXSERVE_INTERNAL_KEY", "bench-key"),
           "PYTHONPATH": os.pathsep.join(p for p in (ROOT, os.environ.get("PYTHONPATH")) if p)}
    gport = _free_port()
    worker = subprocess.Popen([sys.executable, "-m", "bench.gateway_overhead", "--fake-worker", "0",
                               "--step-ms", str(args.step_ms), "--stream-interval", str(args.stream_interval)], cwd=ROOT, env=env, stdout=subprocess.PIPE,
                              stderr=subprocess.STDOUT, text=True, start_new_session=True)
    gateway = None
    try:
        wport = int(_wait_line(worker, "FAKE WORKER").split()[-1])  # bound by the worker: no port race
        gateway = subprocess.Popen([sys.executable, "-m", "services.gateway", "--model-path", "tiny-random",
                                    "--workers", f"127.0.0.1:{wport}", "--port", str(gport), "--log-level", "warning",
                                    "--gateway-processes", str(args.gateway_processes)],
                                   cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                                   start_new_session=True)
        _wait_line(gateway, "gateway ready")
        url = f"http://127.0.0.1:{gport}"
        MODEL["id"] = "tiny-random"
        rng = random.Random(0)
        dataset = [([rng.randrange(10, 400) for _ in range(args.prompt_len)], args.tokens) for _ in range(args.streams)]
        asyncio.run(run_load(url, args.route, dataset[:8], not args.no_stream, float("inf"), 0))  # warm-up
        if args.profile:
            from bench.profile import profile_process
            profile_process(gateway.pid, args.profile, delay=1.0, seconds=3.0)
        gateway_pids = [gateway.pid, *procfs.descendants(gateway.pid)]  # a pool's processes too

        def gateway_cpu() -> float:
            return sum(procfs.run_seconds(p) for p in gateway_pids)
        for rnd in range(args.rounds):
            g0, w0, c0 = gateway_cpu(), procfs.run_seconds(worker.pid), time.process_time()
            results, wall = asyncio.run(run_load(url, args.route, dataset, not args.no_stream, float("inf"),
                                                 args.concurrency))
            g1, w1, c1 = gateway_cpu(), procfs.run_seconds(worker.pid), time.process_time()
            s = summarize(results, wall)
            n = max(1, s["out_tokens"])
            head = f"round {rnd + 1}/{args.rounds}: " if args.rounds > 1 else ""
            print(f"{head}{args.streams} streams x {args.tokens} tokens"
                  f"{f' ({args.concurrency} at a time)' if args.concurrency else ''}, step {args.step_ms:g} ms, "
                  f"{args.route}{'' if not args.no_stream else ' (no stream)'}: {s['out_tok_s']:.0f} out tok/s, "
                  f"tokens {s['out_tokens']}, errors {s['errors']}")
            print(f"  gateway {(g1 - g0) * 1e6 / n:.1f} us/token ({(g1 - g0) * 1e6 / len(results):.0f} us/request), "
                  f"worker IO {(w1 - w0) * 1e6 / n:.1f} us/token, client CPU {(c1 - c0) / wall:.0%}; "
                  f"TTFT p50 {s['ttft_p50_ms']:.1f} ms, ITL p50 {s['itl_p50_ms']:.2f} ms; gateway RSS "
                  f"{sum(procfs.rss_bytes(p) for p in gateway_pids) / 2**20:.0f} MiB", flush=True)
    finally:
        for p in (gateway, worker):
            if p is not None:
                try:
                    os.killpg(p.pid, 9)
                except ProcessLookupError:
                    pass
                p.wait()


if __name__ == "__main__":
    main()
